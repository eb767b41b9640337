// SPDX-License-Identifier: Apache-2.0
// The communicators' optional collectives (what head-parallel and 2D schedules
// need): all-to-all with equal and unequal counts, and split() into
// sub-communicators, for MpiCommunicator at P = 1..4 and SelfCommunicator; the
// compile-time detection; the errors that name the argument.
#include <doctest/doctest.h>

#include <blockattn/comm/communicator.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cstdint>
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

namespace {

using Mpi = MpiCommunicator<>;
using Counts = std::vector<std::int64_t>;

/// A communicator with only what the concept requires (no all-to-all, no split).
struct BasicComm {
  using communicator_type = BasicComm;
  using request_type = SelfCommunicator::request_type;
  SelfCommunicator self;
  int rank() const { return 0; }
  int size() const { return 1; }
  void barrier() {}
  template <class View>
  request_type isend(const View& v, int d, int t) {
    return self.isend(v, d, t);
  }
  template <class View>
  request_type irecv(const View& v, int s, int t) {
    return self.irecv(v, s, t);
  }
  void wait(request_type& r) { self.wait(r); }
  bool test(request_type& r) { return self.test(r); }
  template <class T>
  T allreduce(T v, ReduceOp) {
    return v;
  }
};

static_assert(is_alltoall_communicator_v<Mpi>);
static_assert(is_alltoall_communicator_v<MpiCommunicator<GpuAware>>);
static_assert(is_alltoall_communicator_v<SelfCommunicator>);
static_assert(is_communicator_v<BasicComm> && !is_alltoall_communicator_v<BasicComm>);

template <class T>
auto host_copy(const Kokkos::View<T*, MemSpace>& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

/// Equal counts: chunk j of rank r holds r*100 + j*10 + e; a tail element
/// beyond the chunks must not change.
template <class Comm>
void check_alltoall(Comm& comm, int count) {
  const int P = comm.size(), r = comm.rank();
  const int n = P * count;
  Kokkos::View<double*, MemSpace> send("send", n + 1), recv("recv", n + 1);
  auto hs = Kokkos::create_mirror_view(send);
  for (int j = 0; j < P; ++j)
    for (int e = 0; e < count; ++e) hs(j * count + e) = r * 100 + j * 10 + e;
  hs(n) = -7;
  Kokkos::deep_copy(send, hs);
  Kokkos::deep_copy(recv, -1.0);
  comm.alltoall(ExecSpace{}, send, recv, count);
  auto hr = host_copy(recv);
  INFO("rank ", r, "/", P, " count ", count);
  for (int i = 0; i < P; ++i)
    for (int e = 0; e < count; ++e) CHECK(hr(i * count + e) == i * 100 + r * 10 + e);
  CHECK(hr(n) == -1.0);
}

/// Unequal counts: rank r sends (r + 2 j) mod 3 floats to rank j (zero
/// included), from offsets with gaps; it receives into offsets in reverse rank
/// order. Values r*1000 + j*100 + e.
template <class Comm>
void check_alltoallv(Comm& comm) {
  const int P = comm.size(), r = comm.rank();
  auto cnt = [](int from, int to) { return std::int64_t((from + 2 * to) % 3); };
  const std::size_t np = std::size_t(P);
  Counts sc(np), so(np), rc(np), ro(np);
  std::int64_t at = 1;  // leave element 0 alone
  for (int j = 0; j < P; ++j) {
    sc[std::size_t(j)] = cnt(r, j);
    so[std::size_t(j)] = at;
    at += sc[std::size_t(j)] + 1;
  }
  const std::int64_t send_len = at;
  at = 0;
  for (int i = P - 1; i >= 0; --i) {
    rc[std::size_t(i)] = cnt(i, r);
    ro[std::size_t(i)] = at;
    at += rc[std::size_t(i)];
  }
  const std::int64_t recv_len = at + 1;
  Kokkos::View<float*, MemSpace> send("send", send_len), recv("recv", recv_len);
  auto hs = Kokkos::create_mirror_view(send);
  for (int j = 0; j < P; ++j)
    for (std::int64_t e = 0; e < sc[std::size_t(j)]; ++e)
      hs(so[std::size_t(j)] + e) = float(r * 1000 + j * 100 + e);
  Kokkos::deep_copy(send, hs);
  Kokkos::deep_copy(recv, -1.0f);
  comm.alltoallv(ExecSpace{}, send, sc, so, recv, rc, ro);
  auto hr = host_copy(recv);
  INFO("rank ", r, "/", P);
  for (int i = 0; i < P; ++i)
    for (std::int64_t e = 0; e < rc[std::size_t(i)]; ++e)
      CHECK(hr(ro[std::size_t(i)] + e) == float(i * 1000 + r * 100 + e));
  CHECK(hr(recv_len - 1) == -1.0f);
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}

template <class Comm>
void check_errors(Comm& comm) {
  const int P = comm.size();
  Kokkos::View<double*, MemSpace> small("small", 2 * P - 1), big("big", 4 * P);
  std::string what = error_of([&] { comm.alltoall(ExecSpace{}, small, big, 2); });
  INFO(what);
  CHECK(what.find("argument 'send'") != std::string::npos);
  CHECK(what.find("size() * count") != std::string::npos);
  what = error_of([&] { comm.alltoall(ExecSpace{}, big, small, 2); });
  CHECK(what.find("argument 'recv'") != std::string::npos);
  what = error_of([&] { comm.alltoall(ExecSpace{}, big, big, -1); });
  CHECK(what.find("argument 'count'") != std::string::npos);
  const Counts ok(std::size_t(P), 1), zero(std::size_t(P), 0), wrong(std::size_t(P) + 1, 1);
  what = error_of([&] { comm.alltoallv(ExecSpace{}, big, wrong, zero, big, ok, zero); });
  CHECK(what.find("argument 'send_counts'") != std::string::npos);
  Counts past(std::size_t(P), 0);
  past[0] = std::int64_t(big.extent(0));
  what = error_of([&] { comm.alltoallv(ExecSpace{}, big, ok, zero, big, ok, past); });
  CHECK(what.find("'recv_offsets'[0]") != std::string::npos);
  what = error_of([&] { (void)comm.split(-1, 0); });
  CHECK(what.find("argument 'color'") != std::string::npos);
}

}  // namespace

TEST_CASE("host staging: buffers kept and reused, the data intact") {
  // Host Views staged as device Views are (StagingOptions::stage_host_views):
  // a ring exchange of n floats per round, then an all-to-all and an
  // allreduce through the same buffers.
  Mpi comm(MPI_COMM_WORLD, StagingOptions{4, true});
  const int P = comm.size(), me = comm.rank();
  const ExecSpace exec;
  std::int64_t allocations = 0;
  for (int n : {1000, 1000, 10, 50000, 1000, 50000}) {
    Kokkos::View<float*, MemSpace> send("send", n), recv("recv", n);
    auto h = Kokkos::create_mirror_view(send);
    for (int i = 0; i < n; ++i) h(i) = float(me * 100000 + i);
    Kokkos::deep_copy(send, h);
    auto r = comm.irecv(exec, recv, (me + P - 1) % P, 7);
    auto s = comm.isend(exec, send, (me + 1) % P, 7);
    comm.wait(s);
    comm.wait(r);
    auto got = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    const int from = (me + P - 1) % P;
    int wrong = 0;
    for (int i = 0; i < n; ++i) wrong += got(i) != float(from * 100000 + i) ? 1 : 0;
    INFO("n = ", n);
    CHECK(wrong == 0);
    const StagingStats st = comm.staging_stats();
    // Two buffers for the first size (a send and a receive), two more for
    // the first size past 64 KiB; every other round reuses them.
    allocations = st.allocations;
    CHECK(st.kept <= 4);
  }
  const StagingStats st = comm.staging_stats();
  CHECK(allocations == 4);
  CHECK(st.reuses == 8);
  CHECK(st.kept == 4);
  check_alltoall(comm, 1000);
  Kokkos::View<double*, MemSpace> x("x", 3);
  Kokkos::deep_copy(x, double(me + 1));
  comm.allreduce(exec, x, ReduceOp::sum);
  auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  CHECK(xh(2) == doctest::Approx(double(P) * (P + 1) / 2));
  CHECK(comm.staging_stats().allocations == 4);  // served by the kept buffers
  // At most one buffer kept: the others are freed when they come back.
  Mpi one(MPI_COMM_WORLD, StagingOptions{1, true});
  check_alltoall(one, 100);
  CHECK(one.staging_stats().kept == 1);
}

TEST_CASE("host staging: a message of several chunks, waited for or polled") {
  // Host Views staged as device Views are: 2 BLOCKATTN_STAGING_CHUNK_BYTES
  // and 12 bytes per message (three chunks, the last short), received on an
  // instance (each chunk copied in as it arrives) and without one, completed
  // by wait() and by polling test().
  Mpi comm(MPI_COMM_WORLD, StagingOptions{4, true});
  const int P = comm.size(), me = comm.rank(), from = (me + P - 1) % P;
  const ExecSpace exec;
  const int n = int((2 * BLOCKATTN_STAGING_CHUNK_BYTES + 12) / sizeof(float));
  Kokkos::View<float*, MemSpace> send("send", n), recv("recv", n);
  auto h = Kokkos::create_mirror_view(send);
  for (int i = 0; i < n; ++i) h(i) = float((me * 7919 + i) % 1000003);
  Kokkos::deep_copy(send, h);
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    Kokkos::deep_copy(recv, -1.0f);
    auto r = round % 2 ? comm.irecv(recv, from, 9) : comm.irecv(exec, recv, from, 9);
    auto s = comm.isend(exec, send, (me + 1) % P, 9);
    CHECK(r.chunks.size() == 2);
    if (round < 2) {
      comm.wait(r);
    } else {
      while (!comm.test(r)) {
      }
    }
    comm.wait(s);
    auto got = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    int wrong = 0;
    for (int i = 0; i < n; ++i) wrong += got(i) != float((from * 7919 + i) % 1000003) ? 1 : 0;
    CHECK(wrong == 0);
  }
}

namespace {
/// The part of impl::Transfers a grouped communicator's check uses.
struct GroupedXfer {
  Mpi& comm;
  int agree_max(int v) { return comm.allreduce(v, ReduceOp::max); }
  const char* function() const { return "test"; }
};
}  // namespace

TEST_CASE("grouped communicators: a description with late or after-compute ends is refused") {
  // NcclCommunicator groups a step's transfers: both ends of each must post at
  // the start of the same step. Every rank gets the same verdict, the rank
  // that holds the transfer names it.
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), me = comm.rank();
  GroupedXfer x{comm};
  std::vector<ForwardStep> desc(2);
  desc[0].transfers.push_back({me, ring_next(comm), Payload::kv, 0, 0, false, 0, 0, 1});
  desc[1].transfers.push_back({ring_prev(comm), me, Payload::kv, 1, 1, false, 1, 1, 0});
  impl::require_grouped_posting(x, desc, me);  // the KV ring's: passes
  std::vector<ForwardStep> late = desc;
  if (me == P - 1) late[1].transfers.push_back({me, 0, Payload::result, 1, 1, true, 1, 0, 0});
  const std::string what = error_of([&] { impl::require_grouped_posting(x, late, me); });
  CHECK(what.find("groups each step's transfers") != std::string::npos);
  if (me == P - 1)
    CHECK(what.find("after its compute") != std::string::npos);
  else
    CHECK(what.find("another rank found one") != std::string::npos);
  std::vector<ForwardStep> skew = desc;
  skew[0].transfers[0].dst_step = 1;
  CHECK(error_of([&] { impl::require_grouped_posting(x, skew, me); }).find("(step 1)") !=
        std::string::npos);
}

TEST_CASE("alltoall and alltoallv deliver every chunk where it belongs") {
  Mpi comm(MPI_COMM_WORLD);
  for (int count : {0, 1, 3, 1000}) check_alltoall(comm, count);
  check_alltoallv(comm);
  SelfCommunicator self;
  for (int count : {0, 1, 3}) check_alltoall(self, count);
  check_alltoallv(self);
}

TEST_CASE("split: sub-communicators by color, ordered by key, usable like the parent") {
  Mpi world(MPI_COMM_WORLD);
  const int P = world.size(), r = world.rank();
  // Even and odd ranks, in reverse order of their world rank.
  Mpi sub = world.split(r % 2, -r);
  int same = 0, above = 0, sum = 0;
  for (int i = 0; i < P; ++i)
    if (i % 2 == r % 2) {
      ++same;
      above += i > r ? 1 : 0;
      sum += i;
    }
  CHECK(sub.size() == same);
  CHECK(sub.rank() == above);
  CHECK(sub.allreduce(r, ReduceOp::sum) == sum);
  check_alltoall(sub, 2);
  check_alltoallv(sub);
  // Point to point along the sub-communicator's ring: the world rank of the
  // previous member arrives.
  Kokkos::View<int*, MemSpace> out("out", 1), in("in", 1);
  Kokkos::deep_copy(out, r);
  auto s = sub.isend(out, ring_next(sub), 5);
  auto q = sub.irecv(in, ring_prev(sub), 5);
  sub.wait(q);
  sub.wait(s);
  int prev_world = -1;
  for (int i = P - 1, k = 0; i >= 0; --i)  // sub rank k holds the k-th largest same-parity rank
    if (i % 2 == r % 2) {
      if (k == ring_prev(sub)) prev_world = i;
      ++k;
    }
  CHECK(host_copy(in)(0) == prev_world);
  // A copy shares the communicator; a split of a split works.
  Mpi copy = sub;
  CHECK(copy.size() == sub.size());
  Mpi one = sub.split(sub.rank(), 0);
  CHECK(one.size() == 1);
  CHECK(one.rank() == 0);
  // SelfCommunicator: every color is itself.
  CHECK(SelfCommunicator{}.split(3, 1).size() == 1);
}

TEST_CASE("all-to-all and split errors name the argument") {
  Mpi comm(MPI_COMM_WORLD);
  check_errors(comm);
  SelfCommunicator self;
  check_errors(self);
}
