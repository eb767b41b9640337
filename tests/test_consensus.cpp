// SPDX-License-Identifier: Apache-2.0
// Multi-rank: what ranks must agree on. Bad arguments or a configuration that
// differs on one rank (schedule, partition, mask type or value, value type,
// shapes, options, forward vs backward) throw the same error on every rank,
// before any transfer; the consensus costs one collective per call; a
// transfer that cannot complete times out with a message naming step, peer
// and message; a partition that breaks its contract is rejected; a
// TablePartition must be the same on every rank and built for the call.
// Run under mpiexec with any number of ranks (ctest: 1, 3, 4).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"

#if defined(__NVCC__)
// nvcc's front end warns about members of the test communicators that no test
// here calls (#177-D); they are there to model the communicator concept.
#pragma nv_diag_suppress 177
#endif

using namespace blockattn;
using blockattn::test::ExecSpace;
using blockattn::test::MemSpace;
using Mpi = MpiCommunicator<>;

namespace {

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

/// Inputs of one small call: q = k = v, o, lse, and the gradients.
template <class T>
struct Case {
  V4<T> q, o, dout, dq, dk, dv;
  V3<T> lse;
  Case(int n, int heads, int d)
      : q("q", 1, n, heads, d),
        o("o", 1, n, heads, d),
        dout("dout", 1, n, heads, d),
        dq("dq", 1, n, heads, d),
        dk("dk", 1, n, heads, d),
        dv("dv", 1, n, heads, d),
        lse("lse", 1, heads, n) {
    Kokkos::deep_copy(q, T(0.25));
    Kokkos::deep_copy(dout, T(1));
  }
};

/// The message of the invalid_argument that `f` throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return {};
}

/// True when every rank holds the same string.
bool same_on_every_rank(Mpi& comm, const std::string& s) {
  const std::int64_t h = impl::fingerprint_of(s);
  return comm.allreduce(h, ReduceOp::min) == comm.allreduce(h, ReduceOp::max);
}

template <class Schedule, class Partition = ContiguousPartition, class Mask = CausalMask,
          class Comm = Mpi>
using Attn = DistributedAttention<Partition, Mask, Schedule, Comm, ExecSpace>;

/// Runs forward then backward of `attn` on `c`.
/// A partition without length(): contiguous, N / P tokens per rank.
struct EvenOnlyPartition {
  static constexpr const char* name() { return "even-only"; }
  static index_type multiple_of(int P) { return P; }
  using position_map = OffsetPositions;
  static position_map positions(index_type N, int P, int rank) { return {rank * (N / P)}; }
  static Owner owner(index_type N, int P, index_type t) {
    return Owner{int(t / (N / P)), t % (N / P)};
  }
};

template <class A, class T>
void forward_backward(A& attn, Case<T>& c, const DistributedOptions& opts = {}) {
  attn.forward(c.q, c.q, c.q, c.o, c.lse, opts);
  attn.backward(c.q, c.q, c.q, c.o, c.lse, c.dout, c.dq, c.dk, c.dv, opts);
}

/// Checks that `msg` is the same non-empty error on every rank and contains `needle`.
void check_everywhere(Mpi& comm, const std::string& msg, const std::string& needle) {
  INFO("rank ", comm.rank(), ": ", msg);
  CHECK_FALSE(msg.empty());
  CHECK(msg.find(needle) != std::string::npos);
  CHECK(same_on_every_rank(comm, msg));
}

}  // namespace

TEST_CASE("bad arguments on one rank throw the same error on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  // Rank P-1 passes a k of the wrong head_dim; everyone must throw its message.
  const int d_k = comm.rank() == P - 1 ? 32 : 64;
  V4<double> q("q", 1, 16, 1, 64), k("k", 1, 16, 1, d_k), o("o", 1, 16, 1, 64);
  V3<double> lse("lse", 1, 1, 16);
  Attn<RingSchedule, StripedPartition> attn(comm);
  std::string msg = error_of([&] { attn.forward(q, k, k, o, lse); });
  check_everywhere(comm, msg, "'k'");
  CHECK(msg.find("[rank " + std::to_string(P - 1) + " of " + std::to_string(P)) !=
        std::string::npos);
  CHECK(msg.find("DistributedAttention::forward") != std::string::npos);

  // Local lengths that the partition does not give: N = 16 P + 2 over
  // contiguous ranks is 16 + 1 tokens on ranks 0 and 1, not 18 on rank 0.
  const int n = comm.rank() == 0 && P > 1 ? 18 : 16;
  V4<double> q2("q", 1, n, 1, 8), o2("o", 1, n, 1, 8);
  V3<double> l2("l", 1, 1, n);
  msg = error_of([&] { attn.forward(q2, q2, q2, o2, l2); });
  const std::string layout = "the striped partition of N = " + std::to_string(16 * P + 2) +
                             " tokens (the sum over the ranks) over P = " + std::to_string(P) +
                             " ranks gives ";
  if (P > 2) {  // a majority holds 16: rank 0 is the odd one
    check_everywhere(comm, msg,
                     "rank 0 holds 18 tokens (q.extent(1)) where the other " +
                         std::to_string(P - 1) + " hold 16; " + layout + "16 to rank");
  } else if (P == 2) {  // no majority: every rank's length
    check_everywhere(comm, msg,
                     "the ranks hold 16 tokens on rank 1; 18 tokens on rank 0 (q.extent(1)), no "
                     "length on more than half of them; " +
                         layout + "17 to ranks 0-1");
  } else {
    CHECK(msg.empty());
  }
  // One extra token on rank 1 (of P >= 3): N = 16 P + 1 gives the extra
  // token to rank 0, but the error names rank 1, the odd one.
  if (P >= 3) {
    const int n1 = comm.rank() == 1 ? 17 : 16;
    V4<double> q3("q", 1, n1, 1, 8), o3("o", 1, n1, 1, 8);
    V3<double> l3("l", 1, 1, n1);
    msg = error_of([&] { attn.forward(q3, q3, q3, o3, l3); });
    check_everywhere(comm, msg,
                     "rank 1 holds 17 tokens (q.extent(1)) where the other " +
                         std::to_string(P - 1) + " hold 16");
  }

  // Every rank with no token: nothing to compute, an error on every rank.
  V4<double> q0("q", 1, 0, 1, 8), o0("o", 1, 0, 1, 8);
  V3<double> l0("l", 1, 1, 0);
  msg = error_of([&] { attn.forward(q0, q0, q0, o0, l0); });
  check_everywhere(comm, msg, "every rank holds 0 tokens");

  // A partition without length() still needs N a multiple of multiple_of(P),
  // and says how to lift that.
  if (P > 1) {
    Attn<RingSchedule, EvenOnlyPartition> even(comm);
    const int m = comm.rank() == 0 ? 5 : 4;
    V4<double> q3("q", 1, m, 1, 8), o3("o", 1, m, 1, 8);
    V3<double> l3("l", 1, 1, m);
    msg = error_of([&] { even.forward(q3, q3, q3, o3, l3); });
    check_everywhere(comm, msg, "give the partition a static length(N, P, rank) to allow any N");
  }
}

TEST_CASE("a bad dout on one rank: every rank names DistributedAttention::backward and 'dout'") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  Case<double> c(16, 2, 8);
  V4<double> bad("dout", 1, 16, 2, 4);  // wrong head_dim on the last rank
  auto check = [&](auto attn) {
    attn.forward(c.q, c.q, c.q, c.o, c.lse);
    const std::string msg = error_of([&] {
      attn.backward(c.q, c.q, c.q, c.o, c.lse, comm.rank() == P - 1 ? bad : c.dout, c.dq, c.dk,
                    c.dv);
    });
    check_everywhere(comm, msg, "DistributedAttention::backward");
    CHECK(msg.find("'dout'") != std::string::npos);
    CHECK(msg.find("::forward") == std::string::npos);
  };
  check(Attn<RingSchedule>(comm));
  check(Attn<BurstSchedule>(comm));
  check(Attn<BalancedSchedule>(comm));
}

TEST_CASE("a configuration that differs on one rank throws the same error on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  if (P < 2) return;  // nothing can differ
  const bool odd = comm.rank() == P - 1;
  const std::string last = "on rank " + std::to_string(P - 1);
  Case<double> c(32, 2, 8);

  SUBCASE("schedule: balanced on the last rank, ring elsewhere (used to hang)") {
    const std::string msg = error_of([&] {
      if (odd) {
        Attn<BalancedSchedule> a(comm);
        forward_backward(a, c);
      } else {
        Attn<RingSchedule> a(comm);
        forward_backward(a, c);
      }
    });
    check_everywhere(comm, msg, "schedule differs between ranks");
    CHECK(msg.find("balanced (BalancedSchedule) " + last) != std::string::npos);
  }
  SUBCASE("schedule: burst on the last rank, ring elsewhere (backward used to hang)") {
    const std::string msg = error_of([&] {
      if (odd) {
        Attn<BurstSchedule> a(comm);
        forward_backward(a, c);
      } else {
        Attn<RingSchedule> a(comm);
        forward_backward(a, c);
      }
    });
    check_everywhere(comm, msg, "schedule differs between ranks");
  }
  SUBCASE("partition: striped on the last rank (used to be silently wrong)") {
    const std::string msg = error_of([&] {
      if (odd) {
        Attn<RingSchedule, StripedPartition> a(comm);
        forward_backward(a, c);
      } else {
        Attn<RingSchedule, ContiguousPartition> a(comm);
        forward_backward(a, c);
      }
    });
    check_everywhere(comm, msg, "partition differs between ranks");
    CHECK(msg.find("striped (StripedPartition) " + last) != std::string::npos);
  }
  SUBCASE("mask type: a window on the last rank, causal elsewhere") {
    const std::string msg = error_of([&] {
      if (odd) {
        Attn<RingSchedule, ContiguousPartition, SlidingWindowMask> a(comm, causal_window(32));
        forward_backward(a, c);
      } else {
        Attn<RingSchedule> a(comm);
        forward_backward(a, c);
      }
    });
    check_everywhere(comm, msg, "mask differs between ranks");
  }
  SUBCASE("mask value: a window of 32 on the last rank, 64 elsewhere") {
    Attn<RingSchedule, ContiguousPartition, SlidingWindowMask> a(comm,
                                                                 causal_window(odd ? 32 : 64));
    const std::string msg = error_of([&] { forward_backward(a, c); });
    check_everywhere(comm, msg, "mask value differs between ranks");
    CHECK(msg.find("SlidingWindowMask{31, 0} " + last) != std::string::npos);
  }
  SUBCASE("value type: float on the last rank (used to abort inside MPI_Test)") {
    Case<float> cf(32, 2, 8);
    const std::string msg = error_of([&] {
      Attn<RingSchedule> a(comm);
      if (odd)
        forward_backward(a, cf);
      else
        forward_backward(a, c);
    });
    check_everywhere(comm, msg, "value type differs between ranks");
    CHECK(msg.find("float " + last) != std::string::npos);
    // One machine, one host ISA: the value type is the only difference.
    CHECK(msg.find("host ISA") == std::string::npos);
  }
  SUBCASE("direction: backward on the last rank, forward elsewhere") {
    Attn<RingSchedule> a(comm);
    a.forward(c.q, c.q, c.q, c.o, c.lse);
    const std::string msg = error_of([&] {
      if (odd)
        a.backward(c.q, c.q, c.q, c.o, c.lse, c.dout, c.dq, c.dk, c.dv);
      else
        a.forward(c.q, c.q, c.q, c.o, c.lse);
    });
    check_everywhere(comm, msg, "call differs between ranks");
  }
  SUBCASE("shapes and options") {
    Attn<RingSchedule> a(comm);
    Case<double> wide(32, 4, 8), deep(32, 2, 16);
    std::string msg = error_of([&] { forward_backward(a, odd ? wide : c); });
    check_everywhere(comm, msg, "heads (q.extent(2)) differs between ranks: 2 on rank");
    msg = error_of([&] { forward_backward(a, odd ? deep : c); });
    check_everywhere(comm, msg, "head_dim (q.extent(3)) differs between ranks");
    DistributedOptions opts;
    if (odd) opts.scale = 0.5;
    msg = error_of([&] { forward_backward(a, c, opts); });
    check_everywhere(comm, msg, "options.scale differs between ranks");
    opts = {};
    opts.communicate = !odd;
    msg = error_of([&] { forward_backward(a, c, opts); });
    check_everywhere(comm, msg, "options.communicate differs between ranks");
    opts = {};
    opts.host_matrix = odd ? HostMatrix::off : HostMatrix::automatic;
    msg = error_of([&] { forward_backward(a, c, opts); });
    check_everywhere(comm, msg, "options.host_matrix differs between ranks");
    opts = {};
    opts.portable_only = odd;
    msg = error_of([&] { forward_backward(a, c, opts); });
    check_everywhere(comm, msg, "options.portable_only differs between ranks");
    opts = {};
    opts.tensor_core_backward = odd;
    msg = error_of([&] { forward_backward(a, c, opts); });
    check_everywhere(comm, msg, "options.tensor_core_backward differs between ranks");
  }
  // The same objects work again afterwards: nothing is left pending.
  Attn<RingSchedule> a(comm);
  CHECK_NOTHROW(forward_backward(a, c));
}

namespace {

/// MpiCommunicator that counts its collectives.
class CountingCommunicator {
 public:
  using communicator_type = CountingCommunicator;
  using request_type = Mpi::request_type;
  explicit CountingCommunicator(Mpi comm) : m_comm(comm) {}
  int rank() const { return m_comm.rank(); }
  int size() const { return m_comm.size(); }
  template <class View>
  request_type isend(const View& v, int dest, int tag) {
    return m_comm.isend(v, dest, tag);
  }
  template <class View>
  request_type irecv(const View& v, int source, int tag) {
    return m_comm.irecv(v, source, tag);
  }
  void wait(request_type& r) { m_comm.wait(r); }
  bool test(request_type& r) { return m_comm.test(r); }
  void barrier() {
    ++*m_collectives;
    m_comm.barrier();
  }
  template <class T>
  T allreduce(T value, ReduceOp op) {
    ++*m_collectives;
    return m_comm.allreduce(value, op);
  }
  template <class T>
  void allreduce(const T* in, T* out, int count, ReduceOp op) {
    ++*m_collectives;
    m_comm.allreduce(in, out, count, op);
  }
  int collectives() const { return *m_collectives; }
  void reset() { *m_collectives = 0; }

 private:
  Mpi m_comm;
  std::shared_ptr<int> m_collectives = std::make_shared<int>(0);
};

}  // namespace

TEST_CASE("one collective per forward() and per backward() besides the schedule's transfers") {
  Mpi mpi(MPI_COMM_WORLD);
  CountingCommunicator comm(mpi);
  Case<double> c(32, 2, 8);
  auto count = [&](auto attn, const char* name) {
    INFO(name);
    comm.reset();
    attn.forward(c.q, c.q, c.q, c.o, c.lse);
    CHECK(comm.collectives() == 1);
    comm.reset();
    attn.backward(c.q, c.q, c.q, c.o, c.lse, c.dout, c.dq, c.dk, c.dv);
    CHECK(comm.collectives() == 1);
  };
  count(Attn<RingSchedule, ContiguousPartition, CausalMask, CountingCommunicator>(comm), "ring");
  count(Attn<BurstSchedule, ZigzagPartition, CausalMask, CountingCommunicator>(comm), "burst");
  count(Attn<BalancedSchedule, ContiguousPartition, CausalMask, CountingCommunicator>(comm),
        "balanced");
  // An error costs one more (the failing rank's message travels to all).
  V4<double> bad("dout", 1, 32, 2, 4);
  comm.reset();
  Attn<RingSchedule, ContiguousPartition, CausalMask, CountingCommunicator> a(comm);
  CHECK_FALSE(
      error_of([&] { a.backward(c.q, c.q, c.q, c.o, c.lse, bad, c.dq, c.dk, c.dv); }).empty());
  CHECK(comm.collectives() == 2);
}

namespace {

/// A rank of 2 whose peer never sends: sends complete at once, receives never.
/// The other rank "agrees" to every collective: it contributes what this rank
/// does, and in the consensus step's last P entries (one per rank, the
/// largest value where a rank is not its own) it holds as many tokens.
class SilentPeerCommunicator {
 public:
  using communicator_type = SilentPeerCommunicator;
  struct request_type {
    bool done = false;
  };
  explicit SilentPeerCommunicator(int rank = 0) : m_rank(rank) {}
  int rank() const { return m_rank; }
  int size() const { return 2; }
  template <class View>
  request_type isend(const View&, int, int) {
    return {true};
  }
  template <class View>
  request_type irecv(const View&, int, int) {
    return {false};
  }
  bool test(request_type& r) { return r.done; }
  void wait(request_type&) {
    FAIL("wait() on a receive that never completes (the timeout should poll test())");
  }
  void barrier() {}
  template <class T>
  T allreduce(T value, ReduceOp) {
    return value;
  }
  void allreduce(const std::int64_t* in, std::int64_t* out, int n, ReduceOp) {
    std::copy(in, in + n, out);
    if (n >= 2 && in[n - 1 - m_rank] == std::numeric_limits<std::int64_t>::max())
      out[n - 1 - m_rank] = in[n - 2 + m_rank];  // the peer's slot: our length
  }

 private:
  int m_rank = 0;
};

}  // namespace

TEST_CASE("a transfer that never completes times out naming the step, the peer and the message") {
  Case<double> c(32, 2, 8);
  DistributedOptions opts;
  opts.timeout_seconds = 0.2;
  auto message = [&](auto&& f) {
    try {
      f();
    } catch (const timeout_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  {
    Attn<RingSchedule, ContiguousPartition, CausalMask, SilentPeerCommunicator> a(
        SilentPeerCommunicator{});
    const std::string msg = message([&] { a.forward(c.q, c.q, c.q, c.o, c.lse, opts); });
    INFO(msg);
    CHECK(msg.find("DistributedAttention::forward: step 1: the receive of the K block from "
                   "rank 1") != std::string::npos);
    CHECK(msg.find("timeout_seconds") != std::string::npos);
  }
  {
    Attn<BurstSchedule, ContiguousPartition, CausalMask, SilentPeerCommunicator> a(
        SilentPeerCommunicator{});
    const std::string msg =
        message([&] { a.backward(c.q, c.q, c.q, c.o, c.lse, c.dout, c.dq, c.dk, c.dv, opts); });
    INFO(msg);
    CHECK(msg.find("DistributedAttention::backward: step 1: the receive of the Q block from "
                   "rank 1") != std::string::npos);
  }
  {
    Attn<BalancedSchedule, ContiguousPartition, CausalMask, SilentPeerCommunicator> a(
        SilentPeerCommunicator{1});
    const std::string msg = message([&] { a.forward(c.q, c.q, c.q, c.o, c.lse, opts); });
    INFO(msg);
    // Rank 1 of 2 owns the pair (1, 0) at step 1: it waits for rank 0's K/V.
    CHECK(msg.find("step 1: the receive of the K block from rank 0") != std::string::npos);
  }
}

namespace {

/// Causal, but classify() says `full` for boxes that are only partly allowed.
struct OverconfidentCausal {
  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const { return k <= q; }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type, index_type q1, index_type k0,
                                           index_type) const {
    return k0 > q1 - 1 ? TileKind::empty : TileKind::full;
  }
};

/// Contract violations a user partition may commit.
enum class Broken { decreasing, permutation, owner };

template <Broken B>
struct BrokenPositions {
  index_type N = 0;
  int P = 1, rank = 0;
  KOKKOS_INLINE_FUNCTION index_type operator()(index_type i) const {
    const index_type n = N / P;
    if (B == Broken::decreasing) return index_type(rank) * n + (n - 1 - i);     // reversed chunk
    if (B == Broken::permutation) return ((index_type(rank) * n + i) * 7) % N;  // 7 coprime to N
    return index_type(rank) * n + i;
  }
};

template <Broken B>
struct BrokenPartition {
  static constexpr const char* name() { return "broken"; }
  static index_type multiple_of(int P) { return P; }
  using position_map = BrokenPositions<B>;
  static position_map positions(index_type N, int P, int rank) { return {N, P, rank}; }
  static Owner owner(index_type N, int P, index_type t) {
    const index_type n = N / P;
    if constexpr (B == Broken::owner) {
      return Owner{static_cast<int>(t / n), 0};  // wrong local index
    } else if constexpr (B == Broken::decreasing) {
      return Owner{static_cast<int>(t / n), n - 1 - t % n};
    } else {
      for (int r = 0; r < P; ++r)
        for (index_type i = 0; i < n; ++i)
          if (positions(N, P, r)(i) == t) return Owner{r, i};
      return Owner{-1, -1};
    }
  }
};

}  // namespace

TEST_CASE("check_policies: a mask that breaks its contract is named on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  Case<double> c(16, 1, 8);
  DistributedOptions opts;
  opts.check_policies = true;
  Attn<RingSchedule, StripedPartition, OverconfidentCausal> bad(comm);
  const std::string msg = error_of([&] { bad.forward(c.q, c.q, c.q, c.o, c.lse, opts); });
  check_everywhere(comm, msg, "argument 'mask' breaks the mask contract");
  Attn<RingSchedule, StripedPartition, SlidingWindowMask> good(comm, causal_window(5));
  CHECK_NOTHROW(good.forward(c.q, c.q, c.q, c.o, c.lse, opts));
  if (comm.size() > 1) {
    // Checking on some ranks only would diverge: it is part of the fingerprint.
    DistributedOptions some = opts;
    some.check_policies = comm.rank() == 0;
    const std::string m2 = error_of([&] { good.forward(c.q, c.q, c.q, c.o, c.lse, some); });
    check_everywhere(comm, m2, "options.check_policies (or BLOCKATTN_CHECK_POLICIES) differs");
  }
}

TEST_CASE("a partition that breaks its contract is rejected on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  Case<double> c(8, 1, 8);  // N = 8 P: 7 is coprime to it
  {
    Attn<RingSchedule, BrokenPartition<Broken::decreasing>> a(comm);
    const std::string msg = error_of([&] { a.forward(c.q, c.q, c.q, c.o, c.lse); });
    check_everywhere(comm, msg, "broken partition");
    CHECK(msg.find("positions(N, P, 0)(1) = 6 after 7") != std::string::npos);
    CHECK(msg.find("strictly increasing") != std::string::npos);
  }
  {
    // A random-looking permutation: not increasing on some rank (7 i mod N).
    Attn<RingSchedule, BrokenPartition<Broken::permutation>> a(comm);
    const std::string msg = error_of([&] { a.forward(c.q, c.q, c.q, c.o, c.lse); });
    check_everywhere(comm, msg, "strictly increasing");
    // The permutation helpers check it too.
    V4<double> global("g", 1, 8 * P, 1, 8);
    const std::string msg2 = error_of(
        [&] { to_local<BrokenPartition<Broken::permutation>>(ExecSpace(), P, 0, global, c.q); });
    CHECK(msg2.find("to_local") != std::string::npos);
    CHECK(msg2.find("strictly increasing") != std::string::npos);
  }
  {
    Attn<RingSchedule, BrokenPartition<Broken::owner>> a(comm);
    const std::string msg = error_of([&] { a.forward(c.q, c.q, c.q, c.o, c.lse); });
    check_everywhere(comm, msg, "owner() must invert positions()");
  }
  // The built-in partitions pass their own contract check.
  for (index_type N : {index_type(2 * P), index_type(12 * P)}) {
    CHECK_NOTHROW(check_partition_contract<ContiguousPartition>("test", N, P));
    CHECK_NOTHROW(check_partition_contract<StripedPartition>("test", N, P));
    CHECK_NOTHROW(check_partition_contract<ZigzagPartition>("test", N, P));
  }
}

TEST_CASE("a table partition: the same table on every rank, built for the call's N and P") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  using Table = TablePartition<MemSpace>;
  // Rank r holds 8 tokens: r, r + P, ... (striped), as a table.
  const auto striped = [](int parts, index_type per_rank) {
    std::vector<std::vector<index_type>> t(static_cast<std::size_t>(parts));
    for (index_type x = 0; x < parts * per_rank; ++x) t[std::size_t(x % parts)].push_back(x);
    return t;
  };
  Case<double> c(8, 1, 8);
  {
    Attn<RingSchedule, Table> a(comm, Table(striped(P, 8)));
    CHECK(error_of([&] { forward_backward(a, c); }).empty());
    CHECK(a.partition().size() == 8 * P);
    CHECK(local_length(a.partition(), 8 * P, P, rank) == 8);
  }
  if (P > 1) {
    // The last rank swaps a token of rank 0 with one of rank 1: same lengths,
    // another table.
    auto t = striped(P, 8);
    if (rank == P - 1) std::swap(t[0][3], t[1][3]);
    for (auto& list : t) std::sort(list.begin(), list.end());
    Attn<RingSchedule, Table> a(comm, Table(t));
    const std::string msg = error_of([&] { forward_backward(a, c); });
    check_everywhere(comm, msg, "partition value differs between ranks");
    CHECK(msg.find("on rank " + std::to_string(P - 1)) != std::string::npos);
  }
  {
    // A table for P + 1 ranks used on P ranks: named with both.
    const Table wrong(striped(P + 1, 8));
    Attn<RingSchedule, Table> a(comm, wrong);
    Case<double> c2(int(wrong.length(0, P + 1, rank)) + (rank == P - 1 ? 8 : 0), 1, 8);
    const std::string msg = error_of([&] { forward_backward(a, c2); });
    check_everywhere(
        comm, msg,
        "the table partition holds N = " + std::to_string(8 * (P + 1)) + " tokens over P = " +
            std::to_string(P + 1) + " ranks, but the call has N = " + std::to_string(8 * (P + 1)) +
            " tokens (the sum of the local lengths) over P = " + std::to_string(P) + " ranks");
    // The permutation helpers check it as well.
    V4<double> global("g", 1, 8 * (P + 1), 1, 8);
    CHECK(error_of([&] { to_local(wrong, ExecSpace(), P, rank, global, c2.q); }).find("to_local") !=
          std::string::npos);
  }
  {
    // The permutation helpers name a local extent that does not match: a
    // head count, and the tokens this rank holds.
    V4<double> global("g", 1, 8 * P, 2, 8), heads("l", 1, 8, 3, 8), tokens("l", 1, 7, 2, 8);
    const std::string m1 =
        error_of([&] { to_local<ContiguousPartition>(ExecSpace(), P, rank, global, heads); });
    CHECK_MESSAGE(m1.find("to_local") != std::string::npos, m1);
    CHECK_MESSAGE(m1.find("argument 'local' has extent(2) = 3, expected 2") != std::string::npos,
                  m1);
    const std::string m2 =
        error_of([&] { from_local<ContiguousPartition>(ExecSpace(), P, rank, tokens, global); });
    CHECK_MESSAGE(m2.find("argument 'local' has extent(1) = 7, expected 8") != std::string::npos,
                  m2);
  }
  // The constructor names the first bad entry.
  const auto bad = [](std::vector<std::vector<index_type>> t) {
    return error_of([&] { Table x(t); });
  };
  CHECK(bad({}).find("argument 'ranks' is empty") != std::string::npos);
  CHECK(bad({{}, {}}).find("holds no position") != std::string::npos);
  CHECK(bad({{0, 2}, {1, 3, 3}}).find("ranks[1][2] = 3 after 3") != std::string::npos);
  CHECK(bad({{0, 1}, {1, 2}}).find("ranks[1][0] = 1 is held by rank 0 too") != std::string::npos);
  CHECK(bad({{0, 4}, {1, 2}}).find("ranks[0][1] = 4, expected 0 <= position < N = 4") !=
        std::string::npos);
  CHECK(bad({{2, 0}, {1, 3}}).find("strictly increasing") != std::string::npos);
  // A valid table: lengths, positions and owners as given, any lengths.
  const Table ok({{0, 3, 4}, {}, {1, 2, 5, 6}});
  CHECK(ok.size() == 7);
  CHECK(ok.ranks() == 3);
  CHECK(local_length(ok, 7, 3, 1) == 0);
  CHECK(local_length(ok, 7, 3, 2) == 4);
  CHECK(ok.positions(7, 3, 2)(3) == 6);
  CHECK(ok.owner(7, 3, 5).rank == 2);
  CHECK(ok.owner(7, 3, 5).local == 2);
  CHECK_NOTHROW(check_partition_contract(ok, "test", 7, 3));
  CHECK(max_local_length(ok, 7, 3) == 4);
}
