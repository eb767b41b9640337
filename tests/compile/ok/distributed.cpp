// Control for the composition compile-fail tests: a valid composition.
#include <blockattn/blockattn.hpp>

blockattn::DistributedAttention<blockattn::ZigzagPartition, blockattn::CausalMask,
                                blockattn::RingSchedule, blockattn::SelfCommunicator,
                                Kokkos::DefaultHostExecutionSpace>* p;
auto s = sizeof(*p);
