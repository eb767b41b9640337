// Must NOT compile: the third parameter is not a schedule.
#include <blockattn/blockattn.hpp>

struct MySchedule {};

blockattn::DistributedAttention<blockattn::ZigzagPartition, blockattn::CausalMask, MySchedule,
                                blockattn::SelfCommunicator, Kokkos::Serial>* p;
auto s = sizeof(*p);
