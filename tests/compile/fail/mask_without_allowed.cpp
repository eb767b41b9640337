// Must NOT compile: the mask policy lacks allowed().
#include <blockattn/blockattn.hpp>

struct MaskWithoutAllowed {
  KOKKOS_INLINE_FUNCTION blockattn::TileKind classify(blockattn::index_type, blockattn::index_type,
                                                      blockattn::index_type,
                                                      blockattn::index_type) const {
    return blockattn::TileKind::full;
  }
};

void run(Kokkos::View<float****> q, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, q, q, q, lse, MaskWithoutAllowed{});
}
