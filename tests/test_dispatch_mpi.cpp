// SPDX-License-Identifier: Apache-2.0
// Multi-rank, built for x86-64 with run-time dispatch (blockattn/kernel/isa.hpp):
// the host ISA the fp32 kernels dispatch to is part of what ranks agree on.
// With BLOCKATTN_TEST_MIXED_ISA=1 the odd ranks cap their kernels at avx2 and
// the even ranks at sse2 (as ranks on different CPUs would pick different
// ISAs): every rank must throw the same error naming the field and both
// values, before any transfer. Without it every rank picks the same ISA, and
// forward and backward match the single-device result.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "backend.hpp"

using namespace blockattn;
using blockattn::test::ExecSpace;
using blockattn::test::MemSpace;
using Mpi = MpiCommunicator<>;
using V4 = Kokkos::View<float****, MemSpace>;
using V3 = Kokkos::View<float***, MemSpace>;

TEST_CASE("ranks agree on the host ISA of the fp32 kernels") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  const char* mixed_env = std::getenv("BLOCKATTN_TEST_MIXED_ISA");
  const bool mixed = mixed_env != nullptr && std::string(mixed_env) == "1" && P > 1 &&
                     impl::detect_host_isa() >= HostIsa::avx2;
  // Before the first call into the library: the choice is made once per process.
  if (mixed) setenv("BLOCKATTN_HOST_ISA", rank % 2 ? "avx2" : "sse2", 1);
  const int n = 48, heads = 2, d = 64;  // this rank's tokens
  std::mt19937 rng(unsigned(7 + rank));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  V4 q("q", 1, n, heads, d), k("k", 1, n, heads, d), v("v", 1, n, heads, d), o("o", 1, n, heads, d);
  V3 lse("lse", 1, heads, n);
  for (V4* t : {&q, &k, &v}) {
    auto h = Kokkos::create_mirror_view(*t);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
    Kokkos::deep_copy(*t, h);
  }
  DistributedAttention<ContiguousPartition, CausalMask, RingSchedule, Mpi, ExecSpace> attn(comm);
  std::string msg;
  try {
    attn.forward(q, k, v, o, lse);
  } catch (const invalid_argument& e) {
    msg = e.what();
  }
  const std::string isa = host_isa_name(dispatched_host_isa());
  INFO("rank ", rank, " runs ", isa, ": ", msg);
  if (mixed) {
    CHECK(isa == (rank % 2 ? "avx2" : "sse2"));
    CHECK(msg.find("host ISA of the fp32 kernels") != std::string::npos);
    CHECK(msg.find("avx2") != std::string::npos);
    CHECK(msg.find("sse2") != std::string::npos);
    const std::int64_t h = impl::fingerprint_of(msg);
    CHECK(comm.allreduce(h, ReduceOp::min) == comm.allreduce(h, ReduceOp::max));
  } else {
    CHECK(msg.empty());
    // The same rows on one device (every rank holds all of them: q, k, v of
    // rank r come from seed 7 + r), against this rank's rows.
    const int N = n * P;
    V4 qa("qa", 1, N, heads, d), ka("ka", 1, N, heads, d), va("va", 1, N, heads, d),
        oa("oa", 1, N, heads, d);
    V3 la("la", 1, heads, N);
    for (int r = 0; r < P; ++r) {
      std::mt19937 g(unsigned(7 + r));
      for (V4* t : {&qa, &ka, &va}) {
        auto h = Kokkos::create_mirror_view(*t);
        Kokkos::deep_copy(h, *t);
        for (int i = 0; i < n; ++i)
          for (int hh = 0; hh < heads; ++hh)
            for (int x = 0; x < d; ++x) h(0, r * n + i, hh, x) = u(g);
        Kokkos::deep_copy(*t, h);
      }
    }
    attention_forward(ExecSpace{}, qa, ka, va, oa, la, CausalMask{});
    Kokkos::fence();
    auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, o);
    auto ah = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, oa);
    double worst = 0;
    for (int i = 0; i < n; ++i)
      for (int hh = 0; hh < heads; ++hh)
        for (int x = 0; x < d; ++x)
          worst = std::fmax(
              worst, std::fabs(double(oh(0, i, hh, x)) - double(ah(0, rank * n + i, hh, x))));
    // fp32, V in [-1, 1], at most 192 keys: sums in another order (blocks
    // merged across ranks) differ by a few ulp of O.
    CHECK(worst <= 1e-5);
  }
}
