// Must NOT compile: the fourth parameter is not a communicator.
#include <blockattn/blockattn.hpp>

struct NotACommunicator {
  int rank() const { return 0; }
};

blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask,
                                blockattn::RingSchedule, NotACommunicator, Kokkos::Serial>* p;
auto s = sizeof(*p);
