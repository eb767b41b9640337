// SPDX-License-Identifier: Apache-2.0
// The communicator concept, and SelfCommunicator (one rank, no MPI).
//
// A communicator is a copyable handle with (all host functions)
//   using communicator_type = <itself>;           // it names itself, Kokkos-style
//   using request_type = ...;                     // a pending non-blocking transfer
//   int rank() const;  int size() const;
//   request_type isend(const View& v, int dest, int tag);    // contiguous View
//   request_type irecv(const View& v, int source, int tag);
//   void wait(request_type& r);  bool test(request_type& r);
//   void barrier();
//   template <class T> T allreduce(T value, ReduceOp op);  // int, int64, float, double
// Optional (detected at compile time, used when present):
//   template <class T> void allreduce(const T* in, T* out, int count, ReduceOp op);
//     element-wise, one collective (the consensus step of every collective
//     call is then ONE allreduce; without it, one per element);
//   void allreduce(const ExecSpace& exec, const View& v, ReduceOp op);
//     in place, element-wise over the contiguous View v (int, int64, float,
//     double; host or device memory) written by / read next by work on exec:
//     the merges of serving (decode over a sharded KV cache) use it; without
//     it they stage through the host and the array overload above;
//   request_type isend(const ExecSpace& exec, const View& v, int dest, int tag);
//   request_type irecv(const ExecSpace& exec, const View& v, int source, int tag);
// where `v` was written (or will be read) by work enqueued on `exec`: the
// communicator orders the transfer after that instance only (exec.fence(),
// staging copies on exec), not after all of Kokkos. Without them the schedules
// fence their instance before isend and after a receive completes.
//   void flush();
//     starts the sends and receives posted so far: a communicator that runs
//     a step's transfers as one group (NcclCommunicator: NCCL needs a step's
//     sends and receives in one group, or a ring deadlocks) collects them
//     until then; the schedules call it once a step's transfers are posted
//     (wait() and test() must start what is still collected).
// Optional collectives for head-parallel (all-to-all) schedules; a schedule
// that needs them checks is_alltoall_communicator_v / impl::check_alltoall_communicator
// at compile time:
//   void alltoall(const ExecSpace& exec, const View& send, const View& recv,
//                 std::int64_t count);
//     send holds size() chunks of `count` elements, chunk j for rank j; chunk
//     i of recv receives rank i's chunk for us. Elements of the Views'
//     contiguous spans, in order (any rank of View); nothing else in recv changes.
//   void alltoallv(const ExecSpace& exec, const View& send, const Counts& send_counts,
//                  const Counts& send_offsets, const View& recv, const Counts& recv_counts,
//                  const Counts& recv_offsets);
//     unequal counts (Counts = std::vector<std::int64_t>, size() entries, in
//     elements): send_counts[j] elements from send_offsets[j] go to rank j and
//     arrive at its recv_offsets[our rank]; recv_counts[i] must equal what rank
//     i sends us.
//   communicator_type split(int color, int key) const;
//     collective: the ranks of each color >= 0 form a communicator of the same
//     type, ordered by key (ties: by rank), e.g. the rows and columns of a 2D
//     grid of ranks.
// Ring neighbours come from ring_next() / ring_prev(). MpiCommunicator lives in
// blockattn/comm/mpi_communicator.hpp, the only header that includes <mpi.h>.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {

enum class ReduceOp { sum, max, min };

template <class Comm>
int ring_next(const Comm& c) {
  return (c.rank() + 1) % c.size();
}
template <class Comm>
int ring_prev(const Comm& c) {
  return (c.rank() + c.size() - 1) % c.size();
}

namespace impl {
template <class View>
void require_contiguous(const char* fn, const char* arg, const View& v) {
  if (!v.span_is_contiguous())
    fail(fn, "argument '", arg,
         "' is not contiguous; expected a contiguous View (e.g. LayoutRight)");
}

/// The contiguous span of a View as a 1-D unmanaged View of its elements.
template <class View>
auto flat_view(const View& v) {
  return Kokkos::View<typename View::value_type*, typename View::memory_space,
                      Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(), v.span());
}

using alltoall_counts = std::vector<std::int64_t>;

/// Arguments of an all-to-all with equal counts: contiguous Views whose spans
/// hold `size` chunks of `count` elements.
template <class SendView, class RecvView>
void check_alltoall_args(const char* fn, int size, const SendView& send, const RecvView& recv,
                         std::int64_t count) {
  static_assert(std::is_same<typename SendView::non_const_value_type,
                             typename RecvView::non_const_value_type>::value,
                "BlockAttn: alltoall: send and recv must have the same value type");
  require_contiguous(fn, "send", send);
  require_contiguous(fn, "recv", recv);
  if (count < 0) fail(fn, "argument 'count' = ", count, ", expected >= 0");
  const std::int64_t need = count * size;
  if (std::int64_t(send.span()) < need)
    fail(fn, "argument 'send' holds ", send.span(),
         " elements, expected at least size() * count = ", need);
  if (std::int64_t(recv.span()) < need)
    fail(fn, "argument 'recv' holds ", recv.span(),
         " elements, expected at least size() * count = ", need);
}

/// Arguments of an all-to-all with unequal counts: `size` counts and offsets
/// per side, each chunk inside the View's span.
template <class View>
void check_alltoallv_side(const char* fn, const char* view_arg, const char* counts_arg,
                          const char* offsets_arg, int size, const View& v,
                          const alltoall_counts& counts, const alltoall_counts& offsets) {
  require_contiguous(fn, view_arg, v);
  if (int(counts.size()) != size)
    fail(fn, "argument '", counts_arg, "' has ", counts.size(),
         " entries, expected size() = ", size);
  if (int(offsets.size()) != size)
    fail(fn, "argument '", offsets_arg, "' has ", offsets.size(),
         " entries, expected size() = ", size);
  for (int j = 0; j < size; ++j) {
    const auto c = counts[std::size_t(j)], o = offsets[std::size_t(j)];
    if (c < 0 || o < 0 || o + c > std::int64_t(v.span()))
      fail(fn, "arguments '", counts_arg, "'[", j, "] = ", c, " and '", offsets_arg, "'[", j,
           "] = ", o, " do not lie in '", view_arg, "' of ", v.span(),
           " elements; expected 0 <= offset, 0 <= count, offset + count <= its span");
  }
}

template <class T>
T reduce_pair(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return a + b;
    case ReduceOp::max:
      return a > b ? a : b;
    case ReduceOp::min:
      return a < b ? a : b;
  }
  return a;
}
}  // namespace impl

/// A communicator of one rank: rank 0 of size 1. Sends to itself are matched
/// with receives of the same tag and copied at the receive's wait, so code
/// written for P ranks runs unchanged with P = 1.
class SelfCommunicator {
 public:
  using communicator_type = SelfCommunicator;

  struct request_type {
    std::shared_ptr<void> pending;  // non-null for an unmatched receive
    bool done = false;
  };

  int rank() const { return 0; }
  int size() const { return 1; }

  template <class View>
  request_type isend(const View& v, int dest, int tag) {
    check_peer("isend", dest);
    impl::require_contiguous("SelfCommunicator::isend", "view", v);
    auto& box = m_state->sent[tag];
    box.resize(v.span() * sizeof(typename View::value_type));
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    std::memcpy(box.data(), h.data(), box.size());
    return request_type{nullptr, true};
  }

  template <class View>
  request_type irecv(const View& v, int source, int tag) {
    check_peer("irecv", source);
    impl::require_contiguous("SelfCommunicator::irecv", "view", v);
    auto state = m_state;
    auto deliver = std::make_shared<std::function<bool()>>([state, v, tag]() {
      auto it = state->sent.find(tag);
      if (it == state->sent.end()) return false;
      auto h = Kokkos::create_mirror_view(v);
      if (it->second.size() != v.span() * sizeof(typename View::value_type))
        impl::fail("SelfCommunicator::wait", "message of ", it->second.size(),
                   " bytes for a receive of ", v.span() * sizeof(typename View::value_type),
                   " bytes");
      std::memcpy(h.data(), it->second.data(), it->second.size());
      Kokkos::deep_copy(v, h);
      state->sent.erase(it);
      return true;
    });
    return request_type{deliver, false};
  }

  bool test(request_type& r) {
    if (!r.done && r.pending)
      r.done = (*std::static_pointer_cast<std::function<bool()>>(r.pending))();
    return r.done;
  }
  void wait(request_type& r) {
    if (!test(r))
      impl::fail("SelfCommunicator::wait",
                 "a receive has no matching send; expected isend() with "
                 "the same tag before wait()");
  }
  void barrier() {}
  template <class T>
  T allreduce(T value, ReduceOp) {
    return value;
  }
  template <class T>
  void allreduce(const T* in, T* out, int count, ReduceOp) {
    for (int i = 0; i < count; ++i) out[i] = in[i];
  }
  /// In place over a View: with one rank, nothing changes.
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void allreduce(const ExecSpace&, const View& v, ReduceOp) {
    impl::require_contiguous("SelfCommunicator::allreduce", "view", v);
  }

  /// All-to-all with one rank: chunk 0 of send to chunk 0 of recv.
  template <class ExecSpace, class SendView, class RecvView>
  void alltoall(const ExecSpace& exec, const SendView& send, const RecvView& recv,
                std::int64_t count) {
    impl::check_alltoall_args("SelfCommunicator::alltoall", 1, send, recv, count);
    copy_chunk(exec, send, 0, recv, 0, count);
  }
  template <class ExecSpace, class SendView, class RecvView>
  void alltoallv(const ExecSpace& exec, const SendView& send,
                 const impl::alltoall_counts& send_counts,
                 const impl::alltoall_counts& send_offsets, const RecvView& recv,
                 const impl::alltoall_counts& recv_counts,
                 const impl::alltoall_counts& recv_offsets) {
    const char* fn = "SelfCommunicator::alltoallv";
    impl::check_alltoallv_side(fn, "send", "send_counts", "send_offsets", 1, send, send_counts,
                               send_offsets);
    impl::check_alltoallv_side(fn, "recv", "recv_counts", "recv_offsets", 1, recv, recv_counts,
                               recv_offsets);
    if (send_counts[0] != recv_counts[0])
      impl::fail(fn, "argument 'recv_counts'[0] = ", recv_counts[0],
                 ", expected what rank 0 sends: send_counts[0] = ", send_counts[0]);
    copy_chunk(exec, send, send_offsets[0], recv, recv_offsets[0], send_counts[0]);
  }
  /// Every color gives the same one-rank communicator.
  SelfCommunicator split(int color, int /*key*/) const {
    if (color < 0)
      impl::fail("SelfCommunicator::split", "argument 'color' = ", color, ", expected >= 0");
    return SelfCommunicator{};
  }

 private:
  template <class ExecSpace, class SendView, class RecvView>
  static void copy_chunk(const ExecSpace& exec, const SendView& send, std::int64_t from,
                         const RecvView& recv, std::int64_t to, std::int64_t count) {
    if (count == 0) return;
    const auto s = impl::flat_view(send);
    const auto r = impl::flat_view(recv);
    using range = Kokkos::pair<std::size_t, std::size_t>;
    Kokkos::deep_copy(exec, Kokkos::subview(r, range(std::size_t(to), std::size_t(to + count))),
                      Kokkos::subview(s, range(std::size_t(from), std::size_t(from + count))));
    exec.fence();
  }

  struct State {
    std::map<int, std::vector<char>> sent;
  };
  std::shared_ptr<State> m_state = std::make_shared<State>();

  static void check_peer(const char* fn, int peer) {
    if (peer != 0)
      impl::fail(fn, "peer rank = ", peer, ", expected 0 (SelfCommunicator has size 1)");
  }
};

namespace impl {
using probe_view = Kokkos::View<double*, Kokkos::HostSpace>;

template <class C, class = void>
struct has_comm_basics : std::false_type {};
template <class C>
struct has_comm_basics<C, std::void_t<typename C::communicator_type, typename C::request_type,
                                      decltype(std::declval<const C&>().rank()),
                                      decltype(std::declval<const C&>().size()),
                                      decltype(std::declval<C&>().barrier())>>
    : std::is_same<typename C::communicator_type, C> {};

template <class C, class = void>
struct has_comm_p2p : std::false_type {};
template <class C>
struct has_comm_p2p<
    C, std::void_t<decltype(std::declval<C&>().isend(std::declval<const probe_view&>(), 0, 0)),
                   decltype(std::declval<C&>().irecv(std::declval<const probe_view&>(), 0, 0)),
                   decltype(std::declval<C&>().wait(std::declval<typename C::request_type&>())),
                   decltype(std::declval<C&>().test(std::declval<typename C::request_type&>()))>>
    : std::true_type {};

template <class C, class = void>
struct has_comm_allreduce : std::false_type {};
template <class C>
struct has_comm_allreduce<
    C, std::void_t<decltype(std::declval<C&>().allreduce(1.0, ReduceOp::sum)),
                   decltype(std::declval<C&>().allreduce(std::int64_t(1), ReduceOp::max))>>
    : std::true_type {};

/// The communicator takes the execution-space instance with a transfer.
template <class C, class ExecSpace, class = void>
struct has_comm_exec_p2p : std::false_type {};
template <class C, class ExecSpace>
struct has_comm_exec_p2p<
    C, ExecSpace,
    std::void_t<decltype(std::declval<C&>().isend(std::declval<const ExecSpace&>(),
                                                  std::declval<const probe_view&>(), 0, 0)),
                decltype(std::declval<C&>().irecv(std::declval<const ExecSpace&>(),
                                                  std::declval<const probe_view&>(), 0, 0))>>
    : std::true_type {};

/// isend (Receive false) or irecv (true) of a View written / read by work on
/// `exec`, through the communicator's instance-aware overloads when it has them.
template <bool Receive, class C, class ExecSpace, class View>
typename C::request_type comm_post(C& comm, const ExecSpace& exec, const View& v, int peer,
                                   int tag) {
  if constexpr (!has_comm_exec_p2p<C, ExecSpace>::value) {
    (void)exec;
    if constexpr (Receive)
      return comm.irecv(v, peer, tag);
    else
      return comm.isend(v, peer, tag);
  } else if constexpr (Receive) {
    return comm.irecv(exec, v, peer, tag);
  } else {
    return comm.isend(exec, v, peer, tag);
  }
}
}  // namespace impl

template <class C>
inline constexpr bool is_communicator_v = impl::has_comm_basics<C>::value&&
    impl::has_comm_p2p<C>::value&& impl::has_comm_allreduce<C>::value;

namespace impl {
using probe_exec = Kokkos::DefaultHostExecutionSpace;
template <class C, class = void>
struct has_comm_alltoall : std::false_type {};
template <class C>
struct has_comm_alltoall<
    C,
    std::void_t<decltype(std::declval<C&>().alltoall(
                    std::declval<const probe_exec&>(), std::declval<const probe_view&>(),
                    std::declval<const probe_view&>(), std::int64_t(0))),
                decltype(std::declval<C&>().alltoallv(
                    std::declval<const probe_exec&>(), std::declval<const probe_view&>(),
                    std::declval<const alltoall_counts&>(), std::declval<const alltoall_counts&>(),
                    std::declval<const probe_view&>(), std::declval<const alltoall_counts&>(),
                    std::declval<const alltoall_counts&>()))>> : std::true_type {};
template <class C, class = void>
struct has_comm_split : std::false_type {};
template <class C>
struct has_comm_split<C, std::void_t<decltype(std::declval<const C&>().split(0, 0))>>
    : std::is_same<decltype(std::declval<const C&>().split(0, 0)), C> {};
}  // namespace impl

namespace impl {
/// Optional: flush() (see the top of this file).
template <class C, class = void>
struct has_comm_flush : std::false_type {};
template <class C>
struct has_comm_flush<C, std::void_t<decltype(std::declval<C&>().flush())>> : std::true_type {};

/// Optional: allreduce of n values of T at once (the communicator's array
/// overload, `allreduce(const T* in, T* out, int n, ReduceOp)`).
template <class C, class T, class = void>
struct has_comm_array_allreduce : std::false_type {};
template <class C, class T>
struct has_comm_array_allreduce<
    C, T,
    std::void_t<decltype(std::declval<C&>().allreduce(std::declval<const T*>(), std::declval<T*>(),
                                                      1, ReduceOp::sum))>> : std::true_type {};

/// Optional: an in-place allreduce of a View written by work on `exec`
/// (`allreduce(exec, view, ReduceOp)`: a GPU-aware or device communicator).
template <class C, class ExecSpace, class View, class = void>
struct has_comm_view_allreduce : std::false_type {};
template <class C, class ExecSpace, class View>
struct has_comm_view_allreduce<
    C, ExecSpace, View,
    std::void_t<decltype(std::declval<C&>().allreduce(std::declval<const ExecSpace&>(),
                                                      std::declval<const View&>(), ReduceOp::sum))>>
    : std::true_type {};

/// out[i] = the reduction over the ranks of in[i], i < n: one collective
/// where the communicator has the array overload, one per value otherwise.
template <class C, class T>
void allreduce_values(C& comm, const T* in, T* out, int n, ReduceOp op) {
  if constexpr (has_comm_array_allreduce<C, T>::value) {
    comm.allreduce(in, out, n, op);
  } else {
    for (int i = 0; i < n; ++i) out[i] = comm.allreduce(in[i], op);
  }
}

/// A View (any memory space) reduced over the ranks in place: the
/// communicator's View overload where it has one, else through a host copy
/// and allreduce_values. Waits for `exec`.
template <class C, class ExecSpace, class View>
void allreduce_view(C& comm, const ExecSpace& exec, const View& v, ReduceOp op) {
  if constexpr (has_comm_view_allreduce<C, ExecSpace, View>::value) {
    comm.allreduce(exec, v, op);
  } else {
    using T = typename View::non_const_value_type;
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    std::vector<T> in(h.data(), h.data() + h.span()), out(in.size());
    allreduce_values(comm, in.data(), out.data(), int(in.size()), op);
    std::copy(out.begin(), out.end(), h.data());
    Kokkos::deep_copy(exec, v, h);
    exec.fence();
  }
}
}  // namespace impl

/// A communicator with the optional all-to-all collectives and split() (see
/// the top of this file): what head-parallel and 2D schedules need.
template <class C>
inline constexpr bool is_alltoall_communicator_v =
    is_communicator_v<C>&& impl::has_comm_alltoall<C>::value&& impl::has_comm_split<C>::value;

namespace impl {
template <class C>
constexpr void check_communicator() {
  static_assert(
      has_comm_basics<C>::value,
      "BlockAttn: a communicator must name itself (`using communicator_type = <itself>;`), "
      "name its `request_type`, and have rank(), size() and barrier() "
      "(see blockattn/comm/communicator.hpp)");
  static_assert(
      has_comm_p2p<C>::value,
      "BlockAttn: a communicator must have isend(view, dest, tag), irecv(view, source, tag) "
      "returning request_type, and wait(request&) / test(request&)");
  static_assert(has_comm_allreduce<C>::value,
                "BlockAttn: a communicator must have `T allreduce(T value, ReduceOp op)` for "
                "double and std::int64_t");
}

/// For schedules that need all-to-all: one readable static_assert per missing
/// capability.
template <class C>
constexpr bool check_alltoall_communicator() {
  check_communicator<C>();
  static_assert(has_comm_alltoall<C>::value,
                "BlockAttn: this schedule needs a communicator with all-to-all: "
                "alltoall(exec, send, recv, count) and alltoallv(exec, send, send_counts, "
                "send_offsets, recv, recv_counts, recv_offsets) (see "
                "blockattn/comm/communicator.hpp; MpiCommunicator and SelfCommunicator have them)");
  static_assert(has_comm_split<C>::value,
                "BlockAttn: this schedule needs a communicator with sub-communicators: "
                "communicator_type split(int color, int key) const");
  return has_comm_alltoall<C>::value && has_comm_split<C>::value;
}
}  // namespace impl

}  // namespace blockattn
