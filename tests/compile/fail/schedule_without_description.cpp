// Must NOT compile: a type that looks like a schedule (schedule_type, name(),
// backward_type, supports) but does not describe its steps (steps(), step());
// it must not silently run as another schedule.
#include <blockattn/blockattn.hpp>

struct MySchedule {
  using schedule_type = MySchedule;
  using backward_type = blockattn::KVRingBackward;
  static constexpr const char* name() { return "mine"; }
  template <class Partition, class Mask>
  static constexpr bool supports = true;
};

blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::CausalMask, MySchedule,
                                blockattn::SelfCommunicator, Kokkos::Serial>* p;
auto s = sizeof(*p);
