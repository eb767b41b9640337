// Must NOT compile: the distributed schedules do not take bf16 / fp16 yet.
#include <blockattn/blockattn.hpp>

void run(Kokkos::View<blockattn::fp16****> x, Kokkos::View<float***> lse) {
  blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::CausalMask,
                                  blockattn::RingSchedule, blockattn::SelfCommunicator>
      attn{blockattn::SelfCommunicator{}};
  attn.forward(x, x, x, x, lse);
}
