// Must NOT compile: bf16 values with a bf16 lse (LSE is kept in fp32).
#include <blockattn/blockattn.hpp>

void run(Kokkos::View<blockattn::bf16****> q, Kokkos::View<blockattn::bf16***> lse) {
  blockattn::attention_forward(q, q, q, q, lse);
}
