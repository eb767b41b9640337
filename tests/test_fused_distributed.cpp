// SPDX-License-Identifier: Apache-2.0
// The fused path under the distributed schedules, on the host emulation of
// the fused provider (-DBLOCKATTN_EMULATE_FUSED; CI) or on cuDNN (a CUDA build
// with BLOCKATTN_ENABLE_CUDNN, binary blockattn_test_fused_distributed_cuda): K/V travel in rows,
// own block pairs whose mask is band pieces run fused and merge into the softmax state, the rest
// run on the kernels (after a relayout into their panels). Forward against the fp64 reference with
// the fused bound, against the same call with portable_only, and the steps' paths counted.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <string>

#include "distributed_check.hpp"
#include "forward_check.hpp"

#if defined(BLOCKATTN_EMULATE_FUSED)
#define BLOCKATTN_TEST_PROVIDER "emulated provider"
#elif defined(BLOCKATTN_ENABLE_CUDNN)
#define BLOCKATTN_TEST_PROVIDER "cuDNN"
#else
#error "compile with -DBLOCKATTN_EMULATE_FUSED, or for CUDA with BLOCKATTN_ENABLE_CUDNN"
#endif

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// One schedule x partition x mask in bf16. The bound: the fp32 bound e32,
/// one rounding of O, and the 16-bit rounding of each piece's normalised
/// partial O before the fp32 merge, at most u16 max|V| (weights sum to 1):
///   e32 + u16 (max|O| + e32) + 2 u16 max|V|   (twice for margin; no P in it).
template <class Partition, class Schedule, class Mask>
void check(Mpi& comm, const Mask& mask, int N, int expect_fused) {
  using S = bf16;
  const int P = comm.size(), rank = comm.rank();
  const int b = 1, h = 4, hkv = 2, d = 64;
  std::mt19937_64 rng(4242);
  const HostTensor q = rounded_to<S>(random_tensor(b, N, h, d, rng)),
                   k = rounded_to<S>(random_tensor(b, N, hkv, d, rng)),
                   v = rounded_to<S>(random_tensor(b, N, hkv, d, rng));
  const double scale = 1.0 / std::sqrt(double(d));
  const ReferenceResult ref = reference_attention(q, k, v, mask, scale);
  const int n = int(local_length<Partition>(N, P, rank));
  // [batch, seq, heads, dim] with the head dim contiguous (LayoutRight), as
  // cuDNN needs (Kokkos' default on GPUs is LayoutLeft: those calls take
  // BlockAttn's kernels).
  using R4 = Kokkos::View<S****, Kokkos::LayoutRight, MemSpace>;
  const auto right = [](const V4<S>& x) {
    R4 r("r", x.extent(0), x.extent(1), x.extent(2), x.extent(3));
    Kokkos::deep_copy(r, x);
    return r;
  };
  const R4 ql = right(local_rows<S, Partition>(q, P, rank)),
           kl = right(local_rows<S, Partition>(k, P, rank)),
           vl = right(local_rows<S, Partition>(v, P, rank));
  R4 o("o", b, n, h, d), o_portable("o_portable", b, n, h, d);
  V3<float> lse("lse", b, h, n), lse_portable("lse_portable", b, h, n);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  const RunStats fused = attn.forward(ql, kl, vl, o, lse);
  DistributedOptions opts;
  opts.portable_only = true;
  const RunStats portable = attn.forward(ql, kl, vl, o_portable, lse_portable, opts);
  Kokkos::fence();

  const BlockPathCounts fp = fused.paths(), pp = portable.paths();
  int computed = 0;
  for (const auto& s : fused.steps) computed += s.computed ? 1 : 0;
  CHECK(fp.fused + fp.portable == computed);
  CHECK(pp.fused == 0);
  CHECK(pp.portable == computed);
  const long all_fused = comm.allreduce(long(fp.fused), ReduceOp::sum);
  if (expect_fused >= 0) CHECK((all_fused > 0) == (expect_fused > 0));
  CHECK(fp.fused_pieces >= fp.fused);

  const auto map = Partition::positions(N, P, rank);
  bool finite = true;
  double sums[2] = {0, 0}, sums_p[2] = {0, 0};
  const double eo = max_error(o, ref.o, map, finite, sums);
  const double ep = max_error(o_portable, ref.o, map, finite, sums_p);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  double el = 0.0;
  for (int x = 0; x < h; ++x)
    for (int i = 0; i < n; ++i) {
      const double want = ref.lse[std::size_t(x) * std::size_t(N) + std::size_t(map(i))];
      const double got = lh(0, x, i);
      el = std::isinf(want) ? (got == want ? el : 1e300) : std::fmax(el, std::abs(got - want));
    }
  const double e32 = tolerance<float>(ref, d, N), u = S::unit_roundoff;
  const double bound = e32 + u * (largest(ref.o) + e32) + 2 * u * largest(v);
  INFO("rank " << rank << "/" << P << " " << std::string(Schedule::name()) << " + "
               << std::string(Partition::name()) << ": fused pairs " << fp.fused << " (pieces "
               << fp.fused_pieces << "), portable " << fp.portable << "; O err " << eo
               << " (portable " << ep << ") bound " << bound << "; LSE err " << el);
  CHECK(finite);
  CHECK(eo <= bound);
  CHECK(el <= e32);
}

}  // namespace

TEST_CASE("fused path under the distributed schedules (" BLOCKATTN_TEST_PROVIDER ")") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  const int N = 24 * 2 * P;  // a multiple of 2P: every partition
  check<ZigzagPartition, RingSchedule>(comm, CausalMask{}, N, 1);
  check<StripedPartition, RingSchedule>(comm, CausalMask{}, N, 1);
  check<ContiguousPartition, RingSchedule>(comm, causal_window(20), N, 1);
  check<ContiguousPartition, RingSchedule>(comm, FullMask{}, N + 1, 1);  // uneven pieces
  // Prefix-LM: pairs that straddle the prefix take the kernels in the same call.
  check<ContiguousPartition, RingSchedule>(comm, PrefixLMMask{N / 3}, N, P > 1 ? 1 : 0);
  // Helpers' tasks (another rank's queries) take the kernels.
  check<ContiguousPartition, BalancedSchedule>(comm, CausalMask{}, N, 1);
  check<ContiguousPartition, AllGatherSchedule>(comm, CausalMask{}, N, 1);
}
