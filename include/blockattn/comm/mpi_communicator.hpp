// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: the communicator concept over a user's MPI_Comm. The only
// BlockAttn header that includes <mpi.h>. BlockAttn never calls MPI_Init or
// MPI_Finalize; the communicator does not own or free the MPI_Comm.
#pragma once

#include <mpi.h>

#include <blockattn/comm/communicator.hpp>
#include <blockattn/comm/staging.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace blockattn {

/// Transfer modes: data of Views that the host cannot access is copied through
/// a host buffer (HostStaged, the default), or handed to MPI as is (GpuAware,
/// for CUDA-/ROCm-aware MPI builds).
struct HostStaged {};
struct GpuAware {};

#ifndef BLOCKATTN_STAGING_CHUNK_BYTES
/// Host-staged messages move in chunks of this many bytes (the last one
/// shorter), each its own MPI message: a chunk's device-to-host copy, its
/// transfer and the next chunk's copy overlap. A library constant, not an
/// option, so that every rank cuts a message alike (a rank that cut it
/// otherwise would leave its peer waiting for chunks that never come).
#define BLOCKATTN_STAGING_CHUNK_BYTES (std::size_t(4) << 20)
#endif

/// How MpiCommunicator<HostStaged> stages device memory.
struct StagingOptions {
  /// Staging buffers kept between messages (page-locked where the device
  /// has such memory; the smallest freed first beyond this many).
  std::size_t kept_buffers = 16;
  /// Stage host-accessible Views too (the path device Views take, on any
  /// build: for testing it on CPUs).
  bool stage_host_views = false;
};

template <class Transfer = HostStaged>
class MpiCommunicator {
  static_assert(std::is_same<Transfer, HostStaged>::value ||
                    std::is_same<Transfer, GpuAware>::value,
                "BlockAttn: MpiCommunicator<Transfer>: Transfer must be HostStaged or GpuAware");

 public:
  using communicator_type = MpiCommunicator;

  /// A pending transfer: one MPI message, or a host-staged message's chunks
  /// in order (BLOCKATTN_STAGING_CHUNK_BYTES). `arrived(i)` runs when chunk i
  /// of a host-staged receive is in (its copy into the device View is
  /// enqueued there, while the next chunks still travel), `finish` after the
  /// last (the instance fenced: the staging buffer goes back after it).
  struct request_type {
    MPI_Request request = MPI_REQUEST_NULL;  // the message, or its first chunk
    std::vector<MPI_Request> chunks;         // a staged message's other chunks
    int done = 0;                            // chunks completed (test)
    std::shared_ptr<void> staging;
    std::function<void(int)> arrived;
    std::function<void()> finish;
  };

  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD, const StagingOptions& staging = {})
      : m_comm(comm),
        m_staging(std::make_shared<impl::StagingPool>(staging.kept_buffers)),
        m_stage_host(staging.stage_host_views),
        m_kept(staging.kept_buffers) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      impl::fail("MpiCommunicator",
                 "MPI is not initialized; expected MPI_Init to be called by the "
                 "application before constructing a communicator");
    MPI_Comm_rank(m_comm, &m_rank);
    MPI_Comm_size(m_comm, &m_size);
  }

  /// What the staging buffers did so far (shared by copies of this
  /// communicator; a split() communicator has its own).
  StagingStats staging_stats() const { return m_staging->stats(); }

  int rank() const { return m_rank; }
  int size() const { return m_size; }
  MPI_Comm comm() const { return m_comm; }

  /// Sends a contiguous View. Without an execution-space instance all of
  /// Kokkos is fenced first (the data must be complete before MPI reads it).
  template <class View>
  request_type isend(const View& v, int dest, int tag) {
    Kokkos::fence();
    return post_send("MpiCommunicator::isend", typename View::execution_space{}, v, dest, tag);
  }
  /// Sends a View written by work on `exec`: fences that instance only
  /// (host-staged: the staging copy is enqueued on it, then it is fenced).
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  request_type isend(const ExecSpace& exec, const View& v, int dest, int tag) {
    return post_send("MpiCommunicator::isend", exec, v, dest, tag);
  }

  /// Receives into a contiguous View; host-staged receives copy into it when
  /// the request completes (wait/test), fencing all of Kokkos.
  template <class View>
  request_type irecv(const View& v, int source, int tag) {
    return post_recv<false>("MpiCommunicator::irecv", typename View::execution_space{}, v, source,
                            tag);
  }
  /// Receives into a View that work on `exec` reads next: host-staged data is
  /// copied in on that instance when the request completes.
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  request_type irecv(const ExecSpace& exec, const View& v, int source, int tag) {
    return post_recv<true>("MpiCommunicator::irecv", exec, v, source, tag);
  }

  void wait(request_type& r) {
    const int n = 1 + int(r.chunks.size());
    for (; r.done < n; ++r.done) {
      check(MPI_Wait(chunk(r, r.done), MPI_STATUS_IGNORE), "MPI_Wait");
      if (r.arrived) r.arrived(r.done);
    }
    complete(r);
  }
  bool test(request_type& r) {
    const int n = 1 + int(r.chunks.size());
    while (r.done < n) {
      int flag = 0;
      check(MPI_Test(chunk(r, r.done), &flag, MPI_STATUS_IGNORE), "MPI_Test");
      if (!flag) return false;
      if (r.arrived) r.arrived(r.done);
      ++r.done;
    }
    complete(r);
    return true;
  }
  void barrier() { check(MPI_Barrier(m_comm), "MPI_Barrier"); }

  template <class T>
  T allreduce(T value, ReduceOp op) {
    T out{};
    check(MPI_Allreduce(&value, &out, 1, mpi_type<T>(), mpi_op(op), m_comm), "MPI_Allreduce");
    return out;
  }
  /// Element-wise allreduce of `count` values in one collective.
  template <class T>
  void allreduce(const T* in, T* out, int count, ReduceOp op) {
    check(MPI_Allreduce(in, out, count, mpi_type<T>(), mpi_op(op), m_comm), "MPI_Allreduce");
  }

  /// Element-wise allreduce in place over the contiguous View v (int, int64,
  /// float, double), written by / read next by work on `exec`: one
  /// MPI_Allreduce (MPI_IN_PLACE), through a host copy for device memory
  /// unless the build's MPI is GPU-aware.
  template <class ExecSpace, class View,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void allreduce(const ExecSpace& exec, const View& v, ReduceOp op) {
    using T = typename View::non_const_value_type;
    const char* fn = "MpiCommunicator::allreduce";
    impl::require_contiguous(fn, "view", v);
    const int n = element_count(fn, std::int64_t(v.span()));
    if (staged<View>()) {
      auto flat = impl::flat_view(v);
      const auto buf = stage<View>(flat.extent(0) * sizeof(T));
      const Kokkos::View<T*, staging_space_of<View>, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
          reinterpret_cast<T*>(buf.get()), flat.extent(0));
      Kokkos::deep_copy(exec, h, flat);
      exec.fence();
      check(MPI_Allreduce(MPI_IN_PLACE, h.data(), n, mpi_type<T>(), mpi_op(op), m_comm),
            "MPI_Allreduce");
      Kokkos::deep_copy(exec, flat, h);
    } else {
      exec.fence();
      check(MPI_Allreduce(MPI_IN_PLACE, v.data(), n, mpi_type<T>(), mpi_op(op), m_comm),
            "MPI_Allreduce");
    }
  }

  /// All-to-all with equal counts (MPI_Alltoall): chunk j of `send` (`count`
  /// elements) to rank j, rank i's chunk for us into chunk i of `recv`. The
  /// Views were written by / are read next by work on `exec` (host-staged:
  /// copies through host mirrors on that instance).
  template <class ExecSpace, class SendView, class RecvView,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void alltoall(const ExecSpace& exec, const SendView& send, const RecvView& recv,
                std::int64_t count) {
    const char* fn = "MpiCommunicator::alltoall";
    impl::check_alltoall_args(fn, m_size, send, recv, count);
    const int n = element_count(fn, count);
    collective(exec, send, recv, [&](const void* s, void* r, MPI_Datatype t) {
      check(MPI_Alltoall(s, n, t, r, n, t, m_comm), "MPI_Alltoall");
    });
  }

  /// All-to-all with unequal counts (MPI_Alltoallv), in elements.
  template <class ExecSpace, class SendView, class RecvView,
            class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
  void alltoallv(const ExecSpace& exec, const SendView& send,
                 const impl::alltoall_counts& send_counts,
                 const impl::alltoall_counts& send_offsets, const RecvView& recv,
                 const impl::alltoall_counts& recv_counts,
                 const impl::alltoall_counts& recv_offsets) {
    static_assert(std::is_same<typename SendView::non_const_value_type,
                               typename RecvView::non_const_value_type>::value,
                  "BlockAttn: alltoallv: send and recv must have the same value type");
    const char* fn = "MpiCommunicator::alltoallv";
    impl::check_alltoallv_side(fn, "send", "send_counts", "send_offsets", m_size, send, send_counts,
                               send_offsets);
    impl::check_alltoallv_side(fn, "recv", "recv_counts", "recv_offsets", m_size, recv, recv_counts,
                               recv_offsets);
    const std::size_t P = std::size_t(m_size);
    std::vector<int> sc(P), so(P), rc(P), ro(P);
    for (std::size_t j = 0; j < P; ++j) {
      sc[j] = element_count(fn, send_counts[j]);
      so[j] = element_count(fn, send_offsets[j]);
      rc[j] = element_count(fn, recv_counts[j]);
      ro[j] = element_count(fn, recv_offsets[j]);
    }
    collective(exec, send, recv, [&](const void* s, void* r, MPI_Datatype t) {
      check(MPI_Alltoallv(s, sc.data(), so.data(), t, r, rc.data(), ro.data(), t, m_comm),
            "MPI_Alltoallv");
    });
  }

  /// The ranks with the same color (>= 0) as a communicator of their own
  /// (MPI_Comm_split), ordered by key; collective over this communicator. The
  /// new MPI_Comm belongs to the returned handle and its copies (freed with the
  /// last one, unless MPI is finalized by then).
  MpiCommunicator split(int color, int key) const {
    if (color < 0)
      impl::fail("MpiCommunicator::split", "argument 'color' = ", color, ", expected >= 0");
    MPI_Comm c = MPI_COMM_NULL;
    check(MPI_Comm_split(m_comm, color, key, &c), "MPI_Comm_split");
    std::shared_ptr<MPI_Comm> owned(new MPI_Comm(c), [](MPI_Comm* x) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && *x != MPI_COMM_NULL) MPI_Comm_free(x);
      delete x;
    });
    return MpiCommunicator(std::move(owned), m_kept, m_stage_host);
  }

 private:
  MPI_Comm m_comm;
  int m_rank = 0, m_size = 1;
  std::shared_ptr<MPI_Comm> m_owned;  // set for communicators made by split()
  std::shared_ptr<impl::StagingPool> m_staging;
  bool m_stage_host = false;
  std::size_t m_kept = 16;

  MpiCommunicator(std::shared_ptr<MPI_Comm> owned, std::size_t kept, bool stage_host)
      : m_comm(*owned),
        m_owned(std::move(owned)),
        m_staging(std::make_shared<impl::StagingPool>(kept)),
        m_stage_host(stage_host),
        m_kept(kept) {
    MPI_Comm_rank(m_comm, &m_rank);
    MPI_Comm_size(m_comm, &m_size);
  }

  static int element_count(const char* fn, std::int64_t n) {
    if (n > std::int64_t(std::numeric_limits<int>::max()))
      impl::fail(fn, "count or offset of ", n, " elements exceeds MPI's int; expected at most ",
                 std::numeric_limits<int>::max());
    return int(n);
  }

  /// Runs a collective `op(send_ptr, recv_ptr, element_type)` on host
  /// pointers (host-staged device Views) or the Views' own (host or GPU-aware).
  template <class ExecSpace, class SendView, class RecvView, class Op>
  void collective(const ExecSpace& exec, const SendView& send, const RecvView& recv, Op&& op) {
    using T = typename RecvView::non_const_value_type;
    MPI_Datatype t = MPI_DATATYPE_NULL;
    check(MPI_Type_contiguous(int(sizeof(T)), MPI_BYTE, &t), "MPI_Type_contiguous");
    check(MPI_Type_commit(&t), "MPI_Type_commit");
    if (staged<SendView>() || staged<RecvView>()) {
      auto s = impl::flat_view(send);
      auto r = impl::flat_view(recv);
      // Staged in the host space of whichever side is in device memory.
      using Dev = std::conditional_t<needs_staging<RecvView>(), RecvView, SendView>;
      using Host = Kokkos::View<T*, staging_space_of<Dev>, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
      const auto bs = stage<Dev>(s.extent(0) * sizeof(T));
      const auto br = stage<Dev>(r.extent(0) * sizeof(T));
      const Host hs(reinterpret_cast<T*>(bs.get()), s.extent(0)),
          hr(reinterpret_cast<T*>(br.get()), r.extent(0));
      Kokkos::deep_copy(exec, hs, s);
      Kokkos::deep_copy(exec, hr, r);  // what is not received stays as it was
      exec.fence();
      op(hs.data(), hr.data(), t);
      Kokkos::deep_copy(exec, r, hr);
      exec.fence();
    } else {
      exec.fence();
      op(send.data(), recv.data(), t);
    }
    MPI_Type_free(&t);
  }

  template <class ExecSpace, class View>
  request_type post_send(const char* fn, const ExecSpace& exec, const View& v, int dest, int tag) {
    impl::require_contiguous(fn, "view", v);
    check_peer(fn, dest);
    request_type r;
    const int count = byte_count(v);
    if (staged<View>()) {
      // Into a kept staging buffer on the instance (async where pinned), a
      // chunk at a time: each chunk's MPI message starts as soon as its copy
      // is in, while the next chunk's copy runs (MPI progressed in between).
      const auto buf = stage<View>(std::size_t(count));
      r.staging = buf;
      const auto h = staging_view<View>(buf.get(), count);
      const auto d = bytes_of(v, count);
      const int n = chunk_count(count);
      r.chunks.resize(std::size_t(n - 1));
      for (int i = 0; i < n; ++i) {
        const auto part = chunk_range(count, i);
        Kokkos::deep_copy(exec, Kokkos::subview(h, part), Kokkos::subview(d, part));
        if (i > 0) progress(r, i);
        exec.fence();
        check(MPI_Isend(buf.get() + part.first, int(part.second - part.first), MPI_BYTE, dest, tag,
                        m_comm, chunk(r, i)),
              "MPI_Isend");
      }
    } else {
      exec.fence();
      check(MPI_Isend(v.data(), count, MPI_BYTE, dest, tag, m_comm, &r.request), "MPI_Isend");
    }
    return r;
  }
  template <bool OnInstance, class ExecSpace, class View>
  request_type post_recv(const char* fn, const ExecSpace& exec, const View& v, int source,
                         int tag) {
    impl::require_contiguous(fn, "view", v);
    check_peer(fn, source);
    request_type r;
    const int count = byte_count(v);
    if (staged<View>()) {
      const auto buf = stage<View>(std::size_t(count));
      r.staging = buf;
      const auto h = staging_view<View>(buf.get(), count);
      const auto d = bytes_of(v, count);
      // Each chunk into the View as it arrives (on the instance: the copy
      // runs while the next chunks travel).
      if constexpr (OnInstance) {
        r.arrived = [h, d, exec, count](int i) {
          const auto part = chunk_range(count, i);
          Kokkos::deep_copy(exec, Kokkos::subview(d, part), Kokkos::subview(h, part));
        };
        r.finish = [exec]() { exec.fence(); };  // the staging buffer goes back after this
      } else {
        r.arrived = [h, d, count](int i) {
          const auto part = chunk_range(count, i);
          Kokkos::deep_copy(Kokkos::subview(d, part), Kokkos::subview(h, part));
        };
      }
      const int n = chunk_count(count);
      r.chunks.resize(std::size_t(n - 1));
      for (int i = 0; i < n; ++i) {
        const auto part = chunk_range(count, i);
        check(MPI_Irecv(buf.get() + part.first, int(part.second - part.first), MPI_BYTE, source,
                        tag, m_comm, chunk(r, i)),
              "MPI_Irecv");
      }
    } else {
      check(MPI_Irecv(v.data(), count, MPI_BYTE, source, tag, m_comm, &r.request), "MPI_Irecv");
    }
    return r;
  }

  /// Whether a point-to-point transfer of View goes through a staging buffer.
  template <class View>
  bool staged() const {
    return needs_staging<View>() || (std::is_same<Transfer, HostStaged>::value && m_stage_host);
  }
  template <class View>
  using staging_space_of = impl::staging_space_t<typename View::memory_space>;
  template <class View>
  std::shared_ptr<char> stage(std::size_t bytes) {
    return m_staging->template acquire<staging_space_of<View>>(bytes);
  }
  template <class Space>
  using bytes_view = Kokkos::View<char*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  template <class View>
  static bytes_view<staging_space_of<View>> staging_view(char* p, int count) {
    return bytes_view<staging_space_of<View>>(p, std::size_t(count));
  }
  /// A contiguous View's bytes as a View of char in its memory space.
  template <class View>
  static bytes_view<typename View::memory_space> bytes_of(const View& v, int count) {
    using T = typename View::non_const_value_type;
    return bytes_view<typename View::memory_space>(
        reinterpret_cast<char*>(const_cast<T*>(v.data())), std::size_t(count));
  }

  template <class View>
  static constexpr bool needs_staging() {
    return std::is_same<Transfer, HostStaged>::value &&
           !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible;
  }
  template <class View>
  static int byte_count(const View& v) {
    const std::size_t bytes = v.span() * sizeof(typename View::value_type);
    if (bytes > std::size_t(std::numeric_limits<int>::max()))
      impl::fail("MpiCommunicator", "message of ", bytes,
                 " bytes exceeds MPI's int count; expected at most ",
                 std::numeric_limits<int>::max(), " bytes per message");
    return static_cast<int>(bytes);
  }
  void check_peer(const char* fn, int peer) const {
    if (peer < 0 || peer >= m_size)
      impl::fail(fn, "peer rank = ", peer, ", expected 0 <= rank < ", m_size);
  }
  static void check(int rc, const char* what) {
    if (rc != MPI_SUCCESS) impl::fail("MpiCommunicator", what, " failed with error code ", rc);
  }
  static void complete(request_type& r) {
    if (r.finish) r.finish();
    r.finish = nullptr;
    r.arrived = nullptr;
    r.staging.reset();
  }
  /// Chunk i's request (0: the first, in `request`).
  static MPI_Request* chunk(request_type& r, int i) {
    return i == 0 ? &r.request : &r.chunks[std::size_t(i - 1)];
  }
  /// The chunks of a staged message of `count` bytes (at least one), and
  /// chunk i's bytes [first, second).
  static int chunk_count(int count) {
    const std::size_t c = BLOCKATTN_STAGING_CHUNK_BYTES;
    return count == 0 ? 1 : int((std::size_t(count) + c - 1) / c);
  }
  static Kokkos::pair<std::size_t, std::size_t> chunk_range(int count, int i) {
    const std::size_t c = BLOCKATTN_STAGING_CHUNK_BYTES;
    const std::size_t first = std::size_t(i) * c;
    return {first, std::min(std::size_t(count), first + c)};
  }
  /// Lets MPI move the chunks already posted (0 .. i - 1) while a copy runs.
  static void progress(request_type& r, int i) {
    for (int j = 0; j < i; ++j) {
      int flag = 0;
      MPI_Request* q = chunk(r, j);
      if (*q != MPI_REQUEST_NULL) check(MPI_Test(q, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    }
  }
  template <class T>
  static MPI_Datatype mpi_type() {
    if constexpr (std::is_same<T, double>::value)
      return MPI_DOUBLE;
    else if constexpr (std::is_same<T, float>::value)
      return MPI_FLOAT;
    else if constexpr (std::is_same<T, int>::value)
      return MPI_INT;
    else if constexpr (std::is_same<T, std::int64_t>::value)
      return MPI_INT64_T;
    else
      static_assert(sizeof(T) == 0, "BlockAttn: allreduce supports int, int64_t, float, double");
  }
  static MPI_Op mpi_op(ReduceOp op) {
    switch (op) {
      case ReduceOp::sum:
        return MPI_SUM;
      case ReduceOp::max:
        return MPI_MAX;
      case ReduceOp::min:
        return MPI_MIN;
    }
    return MPI_SUM;
  }
};

}  // namespace blockattn
