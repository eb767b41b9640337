// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: the communicator concept (comm/communicator.hpp) on NCCL,
// for Views in CUDA memory (target BlockAttn::nccl; a Kokkos with CUDA and
// NCCL from the toolkit or NCCL_ROOT).
//
//   MpiCommunicator<> mpi(MPI_COMM_WORLD);                 // or any communicator
//   NcclCommunicator nccl = NcclCommunicator::from(mpi);   // one GPU per rank
//   DistributedAttention<ZigzagPartition, CausalMask, RingSchedule,
//                        NcclCommunicator, Kokkos::Cuda> attn(nccl);
//
// Transfers run on a stream of the communicator's own and never block the
// host: a step's sends and receives are collected and started together as
// one NCCL group at flush() (the schedules call it once a step's transfers
// are posted; wait() and test() start what is still collected), the group
// first waits (CUDA events) for the work enqueued so far on the instances
// that posted them, and wait() makes the instance that reads or writes the
// View next wait for the group's event; test() polls that event.
// Tags are not matched: between two ranks the k-th send meets the k-th
// receive, as the schedules post them (every rank walks the same step
// descriptions in the same order). Collectives (allreduce, alltoall,
// alltoallv, barrier, split) start what is collected first, so that every
// rank issues NCCL calls in the same order.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>

#include <Kokkos_Core.hpp>

#if !defined(KOKKOS_ENABLE_CUDA)
#error "blockattn/comm/nccl_communicator.hpp needs a Kokkos with the CUDA backend"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace blockattn {

namespace impl {

inline void nccl_check(ncclResult_t r, const char* fn, const char* what) {
  if (r != ncclSuccess) fail(fn, what, " failed: ", ncclGetErrorString(r));
}
inline void cuda_check(cudaError_t r, const char* fn, const char* what) {
  if (r != cudaSuccess) fail(fn, what, " failed: ", cudaGetErrorString(r));
}

/// One started NCCL group: the event its stream records when it is done.
struct NcclGroup {
  cudaEvent_t done = nullptr;
  bool started = false;
  NcclGroup() {
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "NcclCommunicator",
               "cudaEventCreateWithFlags");
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() { cudaEventDestroy(done); }
};

/// A collected send or receive.
struct NcclOp {
  bool send;
  void* data;
  std::size_t bytes;
  int peer;
  cudaStream_t stream;  // the posting instance's
};

/// The communicator's state, shared by its copies.
struct NcclState {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int rank = 0, size = 1;
  cudaStream_t stream = nullptr;  // the transfers' and collectives' stream
  std::vector<NcclOp> ops;        // collected since the last start
  std::shared_ptr<NcclGroup> group = std::make_shared<NcclGroup>();
  void* scratch = nullptr;  // device memory for host-side allreduce values
  std::size_t scratch_bytes = 0;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState() {
    if (scratch) cudaFree(scratch);
    if (stream) cudaStreamDestroy(stream);
    if (owned && comm) ncclCommDestroy(comm);
  }
};

}  // namespace impl

class NcclCommunicator {
 public:
  using communicator_type = NcclCommunicator;

  /// A pending send or receive: its group, and the stream of the instance
  /// that uses its View next (made to wait for the group by wait()).
  struct request_type {
    std::shared_ptr<impl::NcclGroup> group;  // null once completed
    cudaStream_t consumer = nullptr;
  };

  /// Wraps a communicator the caller made (and destroys after its last use).
  explicit NcclCommunicator(ncclComm_t comm) : NcclCommunicator(comm, false) {}

  /// Rank `rank` of `size` from an id that one rank made (ncclGetUniqueId)
  /// and every rank has; the communicator is destroyed with the last copy.
  static NcclCommunicator create(const ncclUniqueId& id, int size, int rank) {
    if (size < 1 || rank < 0 || rank >= size)
      impl::fail("NcclCommunicator::create", "rank = ", rank, " of size = ", size,
                 ", expected 0 <= rank < size");
    ncclComm_t c = nullptr;
    impl::nccl_check(ncclCommInitRank(&c, size, id, rank), "NcclCommunicator::create",
                     "ncclCommInitRank");
    return NcclCommunicator(c, true);
  }

  /// One NCCL rank per rank of `bootstrap` (any communicator with the array
  /// allreduce, e.g. MpiCommunicator): rank 0's ncclUniqueId reaches every
  /// rank through a sum; each rank's GPU is Kokkos' current device.
  /// Collective over `bootstrap`.
  template <class Comm>
  static NcclCommunicator from(Comm& bootstrap) {
    static_assert(impl::has_comm_array_allreduce<Comm, int>::value,
                  "BlockAttn: NcclCommunicator::from needs a communicator with the array "
                  "allreduce (allreduce(const T*, T*, int, ReduceOp); MpiCommunicator has it)");
    constexpr int n = int((sizeof(ncclUniqueId) + sizeof(int) - 1) / sizeof(int));
    int in[n] = {}, out[n] = {};
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (bootstrap.rank() == 0) {
      impl::nccl_check(ncclGetUniqueId(&id), "NcclCommunicator::from", "ncclGetUniqueId");
      std::memcpy(in, &id, sizeof(id));
    }
    bootstrap.allreduce(static_cast<const int*>(in), static_cast<int*>(out), n, ReduceOp::sum);
    std::memcpy(&id, out, sizeof(id));
    return create(id, bootstrap.size(), bootstrap.rank());
  }

  int rank() const { return m_state->rank; }
  int size() const { return m_state->size; }
  ncclComm_t comm() const { return m_state->comm; }
  cudaStream_t stream() const { return m_state->stream; }

  /// Sends a contiguous View in CUDA memory written by work on `exec`.
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  request_type isend(const ExecSpace& exec, const View& v, int dest, int tag) {
    return post("NcclCommunicator::isend", true, stream_of(exec), v, dest, tag);
  }
  /// Receives into a contiguous View in CUDA memory read next by work on `exec`.
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  request_type irecv(const ExecSpace& exec, const View& v, int source, int tag) {
    return post("NcclCommunicator::irecv", false, stream_of(exec), v, source, tag);
  }
  /// The same on the default instance of Kokkos::Cuda.
  template <class View>
  request_type isend(const View& v, int dest, int tag) {
    return isend(Kokkos::Cuda(), v, dest, tag);
  }
  template <class View>
  request_type irecv(const View& v, int source, int tag) {
    return irecv(Kokkos::Cuda(), v, source, tag);
  }

  /// Starts the collected sends and receives as one NCCL group (after the
  /// work enqueued so far on their instances). Called by the schedules once
  /// a step's transfers are posted.
  void flush() {
    impl::NcclState& s = *m_state;
    if (s.ops.empty()) return;
    const char* fn = "NcclCommunicator::flush";
    std::vector<cudaStream_t> waited;
    for (const impl::NcclOp& op : s.ops) {
      bool seen = false;
      for (cudaStream_t w : waited) seen = seen || w == op.stream;
      if (!seen) {
        follow(op.stream);
        waited.push_back(op.stream);
      }
    }
    impl::nccl_check(ncclGroupStart(), fn, "ncclGroupStart");
    for (const impl::NcclOp& op : s.ops) {
      if (op.send)
        impl::nccl_check(ncclSend(op.data, op.bytes, ncclUint8, op.peer, s.comm, s.stream), fn,
                         "ncclSend");
      else
        impl::nccl_check(ncclRecv(op.data, op.bytes, ncclUint8, op.peer, s.comm, s.stream), fn,
                         "ncclRecv");
    }
    impl::nccl_check(ncclGroupEnd(), fn, "ncclGroupEnd");
    impl::cuda_check(cudaEventRecord(s.group->done, s.stream), fn, "cudaEventRecord");
    s.group->started = true;
    s.group = std::make_shared<impl::NcclGroup>();
    s.ops.clear();
  }

  /// Orders the instance that uses the View next after the transfer (no
  /// host wait).
  void wait(request_type& r) {
    if (!r.group) return;
    if (!r.group->started) flush();
    impl::cuda_check(cudaStreamWaitEvent(r.consumer, r.group->done, 0), "NcclCommunicator::wait",
                     "cudaStreamWaitEvent");
    r.group.reset();
  }
  /// Whether the transfer's group is done (then as wait()).
  bool test(request_type& r) {
    if (!r.group) return true;
    if (!r.group->started) flush();
    const cudaError_t e = cudaEventQuery(r.group->done);
    if (e == cudaErrorNotReady) return false;
    impl::cuda_check(e, "NcclCommunicator::test", "cudaEventQuery");
    wait(r);
    return true;
  }

  void barrier() {
    const int one = 1;
    (void)allreduce(one, ReduceOp::sum);
  }

  template <class T>
  T allreduce(T value, ReduceOp op) {
    T out{};
    allreduce(&value, &out, 1, op);
    return out;
  }
  /// Element-wise over `count` host values, one collective (waits for it).
  template <class T>
  void allreduce(const T* in, T* out, int count, ReduceOp op) {
    const char* fn = "NcclCommunicator::allreduce";
    if (count < 0) impl::fail(fn, "argument 'count' = ", count, ", expected >= 0");
    flush();
    impl::NcclState& s = *m_state;
    const std::size_t bytes = std::size_t(count) * sizeof(T);
    if (bytes > s.scratch_bytes) {
      if (s.scratch) impl::cuda_check(cudaFree(s.scratch), fn, "cudaFree");
      s.scratch = nullptr;
      s.scratch_bytes = 0;
      impl::cuda_check(cudaMalloc(&s.scratch, bytes), fn, "cudaMalloc");
      s.scratch_bytes = bytes;
    }
    impl::cuda_check(cudaMemcpyAsync(s.scratch, in, bytes, cudaMemcpyHostToDevice, s.stream), fn,
                     "cudaMemcpyAsync");
    impl::nccl_check(ncclAllReduce(s.scratch, s.scratch, std::size_t(count), nccl_type<T>(),
                                   nccl_op(op), s.comm, s.stream),
                     fn, "ncclAllReduce");
    impl::cuda_check(cudaMemcpyAsync(out, s.scratch, bytes, cudaMemcpyDeviceToHost, s.stream), fn,
                     "cudaMemcpyAsync");
    impl::cuda_check(cudaStreamSynchronize(s.stream), fn, "cudaStreamSynchronize");
  }
  /// In place over a contiguous View in CUDA memory, ordered after the work
  /// on `exec` and before what `exec` runs next (no host wait).
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void allreduce(const ExecSpace& exec, const View& v, ReduceOp op) {
    using T = typename View::non_const_value_type;
    const char* fn = "NcclCommunicator::allreduce";
    require_device_view<View>(fn);
    impl::require_contiguous(fn, "view", v);
    flush();
    const cudaStream_t es = stream_of(exec);
    follow(es);
    impl::nccl_check(ncclAllReduce(v.data(), v.data(), v.span(), nccl_type<T>(), nccl_op(op),
                                   m_state->comm, m_state->stream),
                     fn, "ncclAllReduce");
    lead(es);
  }

  /// All-to-all with equal counts (see communicator.hpp), on CUDA Views.
  template <class ExecSpace, class SendView, class RecvView,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void alltoall(const ExecSpace& exec, const SendView& send, const RecvView& recv,
                std::int64_t count) {
    const char* fn = "NcclCommunicator::alltoall";
    impl::check_alltoall_args(fn, size(), send, recv, count);
    const std::size_t P = static_cast<std::size_t>(size());
    impl::alltoall_counts c(P, count), o(P, 0);
    for (std::size_t j = 0; j < P; ++j) o[j] = std::int64_t(j) * count;
    exchange(fn, exec, send, c, o, recv, c, o);
  }
  /// All-to-all with unequal counts, in elements (see communicator.hpp).
  template <class ExecSpace, class SendView, class RecvView,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void alltoallv(const ExecSpace& exec, const SendView& send,
                 const impl::alltoall_counts& send_counts,
                 const impl::alltoall_counts& send_offsets, const RecvView& recv,
                 const impl::alltoall_counts& recv_counts,
                 const impl::alltoall_counts& recv_offsets) {
    const char* fn = "NcclCommunicator::alltoallv";
    impl::check_alltoallv_side(fn, "send", "send_counts", "send_offsets", size(), send, send_counts,
                               send_offsets);
    impl::check_alltoallv_side(fn, "recv", "recv_counts", "recv_offsets", size(), recv, recv_counts,
                               recv_offsets);
    exchange(fn, exec, send, send_counts, send_offsets, recv, recv_counts, recv_offsets);
  }

  /// The ranks of each color >= 0 as a communicator of their own, ordered by
  /// key (ncclCommSplit); collective.
  NcclCommunicator split(int color, int key) const {
    if (color < 0)
      impl::fail("NcclCommunicator::split", "argument 'color' = ", color, ", expected >= 0");
    const_cast<NcclCommunicator*>(this)->flush();
    ncclComm_t c = nullptr;
    impl::nccl_check(ncclCommSplit(m_state->comm, color, key, &c, nullptr),
                     "NcclCommunicator::split", "ncclCommSplit");
    return NcclCommunicator(c, true);
  }

 private:
  std::shared_ptr<impl::NcclState> m_state;

  NcclCommunicator(ncclComm_t comm, bool owned) : m_state(std::make_shared<impl::NcclState>()) {
    const char* fn = "NcclCommunicator";
    if (comm == nullptr) impl::fail(fn, "argument 'comm' is null, expected an NCCL communicator");
    impl::NcclState& s = *m_state;
    s.comm = comm;
    s.owned = owned;
    impl::nccl_check(ncclCommUserRank(comm, &s.rank), fn, "ncclCommUserRank");
    impl::nccl_check(ncclCommCount(comm, &s.size), fn, "ncclCommCount");
    impl::cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), fn,
                     "cudaStreamCreateWithFlags");
  }

  template <class ExecSpace>
  static cudaStream_t stream_of(const ExecSpace& exec) {
    static_assert(std::is_same<ExecSpace, Kokkos::Cuda>::value,
                  "BlockAttn: NcclCommunicator: the execution space must be Kokkos::Cuda");
    return exec.cuda_stream();
  }
  template <class View>
  static void require_device_view(const char* fn) {
    if constexpr (!Kokkos::SpaceAccessibility<Kokkos::Cuda,
                                              typename View::memory_space>::accessible)
      impl::fail(fn, "the View is not in memory the GPU can access (", View::memory_space::name(),
                 "), expected a CUDA memory space");
  }
  /// The communicator's stream waits for the work enqueued so far on `s`.
  void follow(cudaStream_t s) {
    cudaEvent_t e = nullptr;
    const char* fn = "NcclCommunicator";
    impl::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), fn, "cudaEventCreate");
    impl::cuda_check(cudaEventRecord(e, s), fn, "cudaEventRecord");
    impl::cuda_check(cudaStreamWaitEvent(m_state->stream, e, 0), fn, "cudaStreamWaitEvent");
    cudaEventDestroy(e);  // released once the wait is done
  }
  /// `s` waits for the work enqueued so far on the communicator's stream.
  void lead(cudaStream_t s) {
    cudaEvent_t e = nullptr;
    const char* fn = "NcclCommunicator";
    impl::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), fn, "cudaEventCreate");
    impl::cuda_check(cudaEventRecord(e, m_state->stream), fn, "cudaEventRecord");
    impl::cuda_check(cudaStreamWaitEvent(s, e, 0), fn, "cudaStreamWaitEvent");
    cudaEventDestroy(e);
  }

  template <class View>
  request_type post(const char* fn, bool send, cudaStream_t stream, const View& v, int peer,
                    int /*tag: not matched, see the top of this file*/) {
    require_device_view<View>(fn);
    impl::require_contiguous(fn, "view", v);
    if (peer < 0 || peer >= size())
      impl::fail(fn, "peer rank = ", peer, ", expected 0 <= rank < ", size());
    using T = typename View::value_type;
    m_state->ops.push_back(impl::NcclOp{send, const_cast<std::remove_const_t<T>*>(v.data()),
                                        v.span() * sizeof(T), peer, stream});
    return request_type{m_state->group, stream};
  }

  template <class ExecSpace, class SendView, class RecvView>
  void exchange(const char* fn, const ExecSpace& exec, const SendView& send,
                const impl::alltoall_counts& sc, const impl::alltoall_counts& so,
                const RecvView& recv, const impl::alltoall_counts& rc,
                const impl::alltoall_counts& ro) {
    using T = typename RecvView::non_const_value_type;
    static_assert(std::is_same<typename SendView::non_const_value_type, T>::value,
                  "BlockAttn: NcclCommunicator: send and recv must have the same value type");
    require_device_view<SendView>(fn);
    require_device_view<RecvView>(fn);
    flush();
    const cudaStream_t es = stream_of(exec);
    follow(es);
    impl::NcclState& s = *m_state;
    T* const sp = const_cast<T*>(send.data());
    T* const rp = recv.data();
    impl::nccl_check(ncclGroupStart(), fn, "ncclGroupStart");
    for (int j = 0; j < s.size; ++j) {
      const std::size_t jj = std::size_t(j);
      if (sc[jj] > 0)
        impl::nccl_check(
            ncclSend(sp + so[jj], std::size_t(sc[jj]) * sizeof(T), ncclUint8, j, s.comm, s.stream),
            fn, "ncclSend");
      if (rc[jj] > 0)
        impl::nccl_check(
            ncclRecv(rp + ro[jj], std::size_t(rc[jj]) * sizeof(T), ncclUint8, j, s.comm, s.stream),
            fn, "ncclRecv");
    }
    impl::nccl_check(ncclGroupEnd(), fn, "ncclGroupEnd");
    lead(es);
  }

  template <class T>
  static ncclDataType_t nccl_type() {
    if constexpr (std::is_same<T, double>::value)
      return ncclFloat64;
    else if constexpr (std::is_same<T, float>::value)
      return ncclFloat32;
    else if constexpr (std::is_same<T, int>::value)
      return ncclInt32;
    else if constexpr (std::is_same<T, std::int64_t>::value)
      return ncclInt64;
    else
      static_assert(sizeof(T) == 0, "BlockAttn: allreduce supports int, int64_t, float, double");
  }
  static ncclRedOp_t nccl_op(ReduceOp op) {
    switch (op) {
      case ReduceOp::sum:
        return ncclSum;
      case ReduceOp::max:
        return ncclMax;
      case ReduceOp::min:
        return ncclMin;
    }
    return ncclSum;
  }
};

}  // namespace blockattn
