// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator (comm/nccl_communicator.hpp) on Kokkos::Cuda, one GPU per
// rank (ctest nccl_cuda_np1: one rank; on a machine with several GPUs the
// binary runs at P = their count). Its point-to-point transfers around the
// ring, the collectives against their definitions, and DistributedAttention
// on it against attention_forward bit for bit at P = 1 (the consensus, a ring
// of one) and against the same call on MpiCommunicator at any P.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/comm/nccl_communicator.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "distributed_check.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

using Dev = Kokkos::View<float*, Kokkos::CudaSpace>;

std::vector<float> host_of(const Dev& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.span());
}

Dev filled(const char* label, int n, float base) {
  Dev v(std::string(label), n);
  Kokkos::parallel_for(
      "fill", Kokkos::RangePolicy<Kokkos::Cuda>(0, n),
      KOKKOS_LAMBDA(int i) { v(i) = base + float(i); });
  return v;
}

}  // namespace

TEST_CASE("nccl: the ring's transfers, flushed as one group, and polled") {
  Mpi mpi(MPI_COMM_WORLD);
  NcclCommunicator nccl = NcclCommunicator::from(mpi);
  const int P = nccl.size(), me = nccl.rank();
  CHECK(P == mpi.size());
  CHECK(me == mpi.rank());
  const Kokkos::Cuda exec;
  for (int n : {1, 1000, 3 << 20}) {
    CAPTURE(n);
    const Dev a = filled("a", n, float(me * 10000)), b("b", n), c = filled("c", n, -1.0f),
              d("d", n);
    // Two messages to the next rank, received in order from the previous.
    auto r1 = nccl.irecv(exec, b, ring_prev(nccl), 0);
    auto r2 = nccl.irecv(exec, d, ring_prev(nccl), 1);
    auto s1 = nccl.isend(exec, a, ring_next(nccl), 0);
    auto s2 = nccl.isend(exec, c, ring_next(nccl), 1);
    nccl.flush();
    while (!nccl.test(r1)) {
    }
    nccl.wait(r2);
    nccl.wait(s1);
    nccl.wait(s2);
    exec.fence();
    const std::vector<float> got = host_of(b), got2 = host_of(d);
    int wrong = 0;
    const int from = ring_prev(nccl);
    for (int i = 0; i < n; ++i) {
      wrong += got[std::size_t(i)] != float(from * 10000) + float(i);
      wrong += got2[std::size_t(i)] != -1.0f + float(i);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("nccl: allreduce, alltoall, alltoallv, barrier and split") {
  Mpi mpi(MPI_COMM_WORLD);
  NcclCommunicator nccl = NcclCommunicator::from(mpi);
  const int P = nccl.size(), me = nccl.rank();
  const Kokkos::Cuda exec;
  CHECK(nccl.allreduce(me + 1, ReduceOp::sum) == P * (P + 1) / 2);
  CHECK(nccl.allreduce(std::int64_t(me), ReduceOp::max) == std::int64_t(P - 1));
  const double in[3] = {double(me), 1.0, -double(me)};
  double out[3] = {};
  nccl.allreduce(in, out, 3, ReduceOp::min);
  CHECK(out[0] == 0.0);
  CHECK(out[1] == 1.0);
  CHECK(out[2] == -double(P - 1));
  Dev v = filled("v", 5, float(me));
  nccl.allreduce(exec, v, ReduceOp::sum);
  CHECK(host_of(v)[4] == float(P * (P - 1) / 2 + 4 * P));
  nccl.barrier();
  // All-to-all: chunk j of rank i holds 100 i + j.
  const int count = 3;
  Dev send("send", std::size_t(P) * count), recv("recv", std::size_t(P) * count);
  Kokkos::parallel_for(
      "fill", Kokkos::RangePolicy<Kokkos::Cuda>(exec, 0, P * count),
      KOKKOS_LAMBDA(int i) { send(i) = float(100 * me + i / count); });
  nccl.alltoall(exec, send, recv, count);
  exec.fence();
  std::vector<float> got = host_of(recv);
  int wrong = 0;
  for (int i = 0; i < P * count; ++i) wrong += got[std::size_t(i)] != float(100 * (i / count) + me);
  CHECK(wrong == 0);
  std::vector<std::int64_t> c(static_cast<std::size_t>(P), count),
      o(static_cast<std::size_t>(P), 0);
  for (int j = 0; j < P; ++j) o[std::size_t(j)] = std::int64_t(j) * count;
  Kokkos::deep_copy(recv, 0.0f);
  nccl.alltoallv(exec, send, c, o, recv, c, o);
  exec.fence();
  CHECK(host_of(recv) == got);
  NcclCommunicator half = nccl.split(me % 2, me);
  CHECK(half.size() == (P + 1 - me % 2) / 2);
  CHECK(half.allreduce(1, ReduceOp::sum) == half.size());
}

TEST_CASE("nccl: DistributedAttention on NcclCommunicator, MpiCommunicator's bits") {
  Mpi mpi(MPI_COMM_WORLD);
  NcclCommunicator nccl = NcclCommunicator::from(mpi);
  const int P = mpi.size(), me = mpi.rank();
  const int n = 96, N = n * P, H = 4, D = 64;
  std::mt19937_64 rng(91);
  HostTensor q = random_tensor(1, N, H, D, rng), k = random_tensor(1, N, H, D, rng),
             v = random_tensor(1, N, H, D, rng);
  const auto local = [&](const HostTensor& t) {
    V4<float> x("x", 1, n, H, D);
    auto h = Kokkos::create_mirror_view(x);
    for (int i = 0; i < n; ++i)
      for (int a = 0; a < H; ++a)
        for (int d = 0; d < D; ++d) h(0, i, a, d) = float(t(0, me * n + i, a, d));
    Kokkos::deep_copy(x, h);
    return x;
  };
  const V4<float> ql = local(q), kl = local(k), vl = local(v);
  V4<float> o1("o1", 1, n, H, D), o2("o2", 1, n, H, D);
  V3<float> l1("l1", 1, H, n), l2("l2", 1, H, n);
  DistributedAttention<ContiguousPartition, CausalMask, RingSchedule, NcclCommunicator, ExecSpace>
      on_nccl(nccl);
  DistributedAttention<ContiguousPartition, CausalMask, RingSchedule, Mpi, ExecSpace> on_mpi(mpi);
  const RunStats st = on_nccl.forward(ql, kl, vl, o1, l1);
  on_mpi.forward(ql, kl, vl, o2, l2);
  Kokkos::fence();
  CHECK(int(st.steps.size()) == P);
  const auto h1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o1);
  const auto h2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o2);
  int differ = 0;
  for (std::size_t i = 0; i < h1.span(); ++i) differ += h1.data()[i] != h2.data()[i];
  CHECK(differ == 0);
}
