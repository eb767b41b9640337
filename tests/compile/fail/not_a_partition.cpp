// Must NOT compile: a mask where the partition belongs.
#include <blockattn/blockattn.hpp>

blockattn::DistributedAttention<blockattn::CausalMask, blockattn::CausalMask,
                                blockattn::RingSchedule, blockattn::SelfCommunicator,
                                Kokkos::Serial>* p;
auto s = sizeof(*p);
