// Must NOT compile: the balanced schedule needs a contiguous partition.
#include <blockattn/blockattn.hpp>

blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask,
                                blockattn::BalancedSchedule, blockattn::SelfCommunicator,
                                Kokkos::Serial>* p;
auto s = sizeof(*p);
