// Must NOT compile: bf16 values with fp32 gradients in the distributed backward.
#include <blockattn/blockattn.hpp>

void run(Kokkos::View<blockattn::bf16****> x, Kokkos::View<float***> lse,
         Kokkos::View<float****> g) {
  blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::CausalMask,
                                  blockattn::RingSchedule, blockattn::SelfCommunicator>
      attn{blockattn::SelfCommunicator{}};
  attn.backward(x, x, x, x, lse, x, g, g, g);
}
