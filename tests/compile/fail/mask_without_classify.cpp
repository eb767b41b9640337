// Must NOT compile: the mask policy lacks classify(). The test passes when the
// compiler prints BlockAttn's static_assert message.
#include <blockattn/blockattn.hpp>

struct MaskWithoutClassify {
  KOKKOS_INLINE_FUNCTION bool allowed(blockattn::index_type q, blockattn::index_type k) const {
    return k <= q;
  }
};

void run(Kokkos::View<float****> q, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, q, q, q, lse, MaskWithoutClassify{});
}
