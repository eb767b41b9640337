// Control for the compile-fail tests: a correct call compiles with the same
// flags, so a failure there is BlockAttn's static_assert and nothing else.
#include <blockattn/blockattn.hpp>

struct GoodMask {
  KOKKOS_INLINE_FUNCTION blockattn::TileKind classify(blockattn::index_type, blockattn::index_type,
                                                      blockattn::index_type,
                                                      blockattn::index_type) const {
    return blockattn::TileKind::partial;
  }
  KOKKOS_INLINE_FUNCTION bool allowed(blockattn::index_type q, blockattn::index_type k) const {
    return k <= q;
  }
};

void run(Kokkos::View<float****> q, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, q, q, q, lse, GoodMask{});
}
