// Must NOT compile: a memory space where the execution space belongs.
#include <blockattn/blockattn.hpp>

blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::FullMask,
                                blockattn::RingSchedule, blockattn::SelfCommunicator,
                                Kokkos::HostSpace>* p;
auto s = sizeof(*p);
