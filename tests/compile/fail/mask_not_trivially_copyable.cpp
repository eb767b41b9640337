// Must NOT compile: the mask policy holds a std::string, so it cannot be copied into kernels.
#include <blockattn/blockattn.hpp>

#include <string>

struct MaskWithString {
  std::string name;
  KOKKOS_INLINE_FUNCTION blockattn::TileKind classify(blockattn::index_type, blockattn::index_type,
                                                      blockattn::index_type,
                                                      blockattn::index_type) const {
    return blockattn::TileKind::full;
  }
  KOKKOS_INLINE_FUNCTION bool allowed(blockattn::index_type, blockattn::index_type) const {
    return true;
  }
};

void run(Kokkos::View<float****> q, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, q, q, q, lse, MaskWithString{});
}
