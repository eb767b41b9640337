// Must NOT compile: q is rank 3.
#include <blockattn/blockattn.hpp>

void run(Kokkos::View<float***> q, Kokkos::View<float****> k, Kokkos::View<float***> lse) {
  blockattn::attention_forward(q, k, k, k, lse);
}
