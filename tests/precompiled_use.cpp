// SPDX-License-Identifier: Apache-2.0
// One single-device forward and backward (fp32, causal) and one distributed
// forward (zigzag ring, bf16): with BlockAttn::kernels linked, this object
// must reference the block product's kernels and define none of them
// (check_precompiled.sh; ctest kernels_precompiled).
#include <blockattn/blockattn.hpp>

void blockattn_precompiled_use(Kokkos::View<float****, Kokkos::HostSpace> q,
                               Kokkos::View<float***, Kokkos::HostSpace> lse) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  blockattn::attention_forward(Exec{}, q, q, q, q, lse, blockattn::CausalMask{});
  blockattn::attention_backward(Exec{}, q, q, q, q, lse, q, q, q, q, blockattn::CausalMask{});
  Kokkos::View<blockattn::bf16****, Kokkos::HostSpace> h("h", 1, 8, 1, 8);
  Kokkos::View<float***, Kokkos::HostSpace> hl("hl", 1, 1, 8);
  blockattn::DistributedAttention<blockattn::ZigzagPartition, blockattn::CausalMask,
                                  blockattn::RingSchedule, blockattn::SelfCommunicator, Exec>
      attn(blockattn::SelfCommunicator{});
  attn.forward(h, h, h, h, hl);
}
