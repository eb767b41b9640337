// Must NOT compile: the balanced schedule needs a causal mask.
#include <blockattn/blockattn.hpp>

blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::FullMask,
                                blockattn::BalancedSchedule, blockattn::SelfCommunicator,
                                Kokkos::Serial>* p;
auto s = sizeof(*p);
