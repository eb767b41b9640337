// Must NOT compile: q is double, the rest float.
#include <blockattn/blockattn.hpp>

void run(Kokkos::View<double****> q, Kokkos::View<float****> k, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, k, k, k, lse);
}
