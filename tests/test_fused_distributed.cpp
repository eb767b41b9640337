// SPDX-License-Identifier: Apache-2.0
// The fused path under the distributed schedules, on the host emulation of
// the fused provider (-DBLOCKATTN_EMULATE_FUSED; CI) or on cuDNN (a CUDA build
// with BLOCKATTN_ENABLE_CUDNN, binary blockattn_test_fused_distributed_cuda): K/V travel in rows,
// own block pairs whose mask is band pieces run fused and merge into the softmax state, the rest
// run on the kernels (after a relayout into their panels). Forward against the fp64 reference with
// the fused bound, against the same call with portable_only, and the steps' paths counted. The
// backward likewise: own block pairs whose mask is band pieces on the provider (each piece's 16-bit
// gradients added into the fp32 sums), against the fp64 gradients with the fused backward bound
// (backward_bound below) and against portable_only within the kernels' bound.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

/// A rank's rows of a (1, n, heads, dim) View into the global tensor of every
/// rank (summed over the ranks: each global row is one rank's).
template <class View, class Map>
HostTensor gather_rows(const View& x, const Map& map, int N) {
  const int n = int(x.extent(1)), h = int(x.extent(2)), d = int(x.extent(3));
  auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  HostTensor t(1, N, h, d);
  for (int i = 0; i < n; ++i)
    for (int a = 0; a < h; ++a)
      for (int c = 0; c < d; ++c) t(0, int(map(i)), a, c) = double(float(xh(0, i, a, c)));
  MPI_Allreduce(MPI_IN_PLACE, t.data.data(), int(t.data.size()), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  return t;
}

/// The paths of one call (forward or backward) and of the same call with
/// portable_only: every computed step counted once; none fused with
/// portable_only; fused pairs on some rank exactly when `expect_fused` > 0
/// (< 0: not checked). Returns the call's counts.
BlockPathCounts check_paths(Mpi& comm, const RunStats& call, const RunStats& portable,
                            int expect_fused) {
  const BlockPathCounts fp = call.paths(), pp = portable.paths();
  int computed = 0;
  for (const auto& st : call.steps) computed += st.computed ? 1 : 0;
  CHECK(fp.fused + fp.portable == computed);
  CHECK(pp.fused == 0);
  CHECK(pp.portable == computed);
  const long all_fused = comm.allreduce(long(fp.fused), ReduceOp::sum);
  if (expect_fused >= 0) CHECK((all_fused > 0) == (expect_fused > 0));
  CHECK(fp.fused_pieces >= fp.fused);
  return fp;
}

/// The computed steps of a call on another rank's queries, and how many of
/// them ran fused.
std::pair<long, long> foreign_steps(const RunStats& call, int rank) {
  long all = 0, fused = 0;
  for (const auto& st : call.steps)
    if (st.computed && st.query_source != rank) {
      ++all;
      fused += st.path == BlockPath::fused ? 1 : 0;
    }
  return {all, fused};
}

/// Which driver runs a check: DistributedAttention with the schedule,
/// UlyssesAttention, or HybridAttention with one group of every rank (the
/// schedule's ring across one group); the last two over a contiguous layout.
enum class Driver { schedule, ulysses, hybrid };

/// f(attn) on the driver's object.
template <class Partition, class Schedule, class Mask, class F>
void with_driver(Mpi& comm, Driver driver, const Mask& mask, const F& f) {
  if (driver == Driver::ulysses) {
    UlyssesAttention<Partition, Mask, Mpi, ExecSpace> attn(comm, mask);
    f(attn);
  } else if (driver == Driver::hybrid) {
    HybridAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, comm.size(), mask);
    f(attn);
  } else {
    DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
    f(attn);
  }
}

/// One schedule x partition x mask in bf16. The bound: the fp32 bound e32,
/// one rounding of O, and the 16-bit rounding of each piece's normalised
/// partial O before the fp32 merge, at most u16 max|V| (weights sum to 1):
///   e32 + u16 (max|O| + e32) + 2 u16 max|V|   (twice for margin; no P in it).
template <class Partition, class Schedule, class Mask>
void check(Mpi& comm, const Mask& mask, int N, int expect_fused, bool expect_helpers = false,
           bool with_sinks = false, bool travelled_backward = false, bool tc_backward = false,
           Driver driver = Driver::schedule) {
  using S = bf16;
  const int P = comm.size(), rank = comm.rank();
  // 12 heads for the head-parallel drivers: P = 1 ... 4 split them.
  const bool heads_split = driver != Driver::schedule;
  const int b = 1, h = heads_split ? 12 : 4, hkv = heads_split ? 12 : 2, d = 64;
  std::mt19937_64 rng(4242);
  const HostTensor q = rounded_to<S>(random_tensor(b, N, h, d, rng)),
                   k = rounded_to<S>(random_tensor(b, N, hkv, d, rng)),
                   v = rounded_to<S>(random_tensor(b, N, hkv, d, rng));
  const double scale = 1.0 / std::sqrt(double(d));
  // Attention sinks (one logit per head; the -inf one: no sink) on O and LSE after the
  // merges, and in the backward's P through the LSE.
  const std::vector<double> sink_values{0.5, -1.0, 1.5, -std::numeric_limits<double>::infinity()};
  const std::vector<double>* sv = with_sinks ? &sink_values : nullptr;
  Kokkos::View<float*, MemSpace> sinks("sinks", h);
  {
    auto sh = Kokkos::create_mirror_view(sinks);
    for (int x = 0; x < h; ++x) sh(x) = float(sink_values[std::size_t(x % 4)]);
    Kokkos::deep_copy(sinks, sh);
  }
  const ReferenceResult ref = reference_attention(q, k, v, mask, scale, 0, 0, sv);
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
  DistributedOptions with;  // the fused path (default), with or without sinks
  if (with_sinks) with.sinks = sinks;
  DistributedOptions opts = with;
  opts.portable_only = true;
  RunStats fused, portable;
  with_driver<Partition, Schedule>(comm, driver, mask, [&](auto& attn) {
    fused = attn.forward(ql, kl, vl, o, lse, with);
    portable = attn.forward(ql, kl, vl, o_portable, lse_portable, opts);
  });
  Kokkos::fence();
  // The pairs cuDNN declines run on the tensor-core forward where it is
  // compiled (the CUDA emulator's build): counted as matrix.
  if (expect_fused == 0 && impl::flash_enabled<ExecSpace, S, Mask>())
    CHECK(comm.allreduce(long(fused.paths().matrix), ReduceOp::sum) > 0);

  const BlockPathCounts fp = check_paths(comm, fused, portable, expect_fused);
  // Helpers' tasks (another rank's queries, balanced schedule) run fused too.
  const auto [helpers, helpers_fused] = foreign_steps(fused, rank);
  if (expect_helpers) {
    CHECK(comm.allreduce(helpers, ReduceOp::sum) > 0);
    CHECK(comm.allreduce(helpers_fused, ReduceOp::sum) == comm.allreduce(helpers, ReduceOp::sum));
  }

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
  INFO("rank " << rank << "/" << P << (with_sinks ? " sinks " : " ")
               << std::string(Schedule::name()) << " + " << std::string(Partition::name())
               << ": fused pairs " << fp.fused << " (pieces " << fp.fused_pieces << "), portable "
               << fp.portable << "; O err " << eo << " (portable " << ep << ") bound " << bound
               << "; LSE err " << el);
  CHECK(finite);
  CHECK(eo <= bound);
  CHECK(el <= e32);

  // The backward of the fused forward's O and LSE, fused and portable_only.
  const HostTensor dout = rounded_to<S>(random_tensor(b, N, h, d, rng));
  const R4 dol = right(local_rows<S, Partition>(dout, P, rank));
  R4 dq("dq", b, n, h, d), dk("dk", b, n, hkv, d), dv("dv", b, n, hkv, d);
  R4 dq_p("dq_p", b, n, h, d), dk_p("dk_p", b, n, hkv, d), dv_p("dv_p", b, n, hkv, d);
  // tc_backward: the pairs cuDNN does not take on the tensor-core backward
  // where it is compiled (CUDA), on the kernels elsewhere.
  DistributedOptions bwith = with;
  bwith.tensor_core_backward = tc_backward;
  RunStats bf, bp;
  with_driver<Partition, Schedule>(comm, driver, mask, [&](auto& attn) {
    bf = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv, bwith);
    bp = attn.backward(ql, kl, vl, o, lse, dol, dq_p, dk_p, dv_p, opts);
  });
  Kokkos::fence();
  const BlockPathCounts bfp = check_paths(comm, bf, bp, expect_fused);
  // (UlyssesAttention reports no fused workspace: its local call holds it.)
  if (bfp.fused > 0 && driver != Driver::ulysses) CHECK(bf.fused_workspace_bytes > 0);
  // Pairs of travelled queries (Q ring, balanced helpers): fused too, from a
  // proxy O (fused_travelled_rows), with every mask here a band.
  const auto [travelled, travelled_fused] = foreign_steps(bf, rank);
  // The host matrix engine (AMX) runs the portable pairs of a bf16 backward
  // where the CPU has it; UlyssesAttention's local call counts them as
  // matrix (the ring schedules' steps count them as portable).
  BackwardBlockOptions bf16_operands;
  bf16_operands.operands_bf16 = true;
  const bool engine = backward_uses_matrix<float, ExecSpace, Mask>(d, bf16_operands);
  if (tc_backward && tensor_core_backward_available_v<ExecSpace, S, Mask>)
    CHECK(comm.allreduce(long(bfp.matrix), ReduceOp::sum) > 0);
  else if (!(engine && std::is_same<S, bf16>::value))
    CHECK(bfp.matrix == 0);
  if (travelled_backward) {
    CHECK(comm.allreduce(travelled, ReduceOp::sum) > 0);
    CHECK(comm.allreduce(travelled_fused, ReduceOp::sum) ==
          comm.allreduce(travelled, ReduceOp::sum));
  }

  // fp64 gradients from the O the forward returned (what both backwards use).
  const HostTensor og = gather_rows(o, map, N);
  // With each element's sum of absolute terms (ReferenceGrads::abs_dq, ...).
  const ReferenceGrads gr = reference_backward(q, k, v, dout, mask, scale, 0, 0, &og, sv, true);
  // Bounds per element x of a gradient whose largest reference entry is L:
  // the kernels (fp32, rounded once): 1e-4 L + u16 (|x| + L), as the
  // single-device 16-bit tests, plus 2 u16 L where the bf16 backward runs on
  // the host matrix engine (P and dS in bf16; test_half_distributed.cpp);
  // fused: plus 4 u16 |x|_abs (the sum of x's absolute terms: each piece's
  // partial rounded to 16 bits once, a provider that rounds P and dS to 16
  // bits, as cuDNN does, up to twice more per term, and a travelled slot's D
  // from a proxy O within one rounding: fused_travelled_rows).
  const auto worst = [&](const R4& got, const HostTensor& want, const HostTensor& abs_terms,
                         bool fused_bound, bool& fin) {
    auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
    const double L = largest(want);
    double w = 0.0;
    for (int i = 0; i < n; ++i)
      for (int a = 0; a < int(got.extent(2)); ++a)
        for (int c = 0; c < d; ++c) {
          const double x = want(0, int(map(i)), a, c), y = double(float(gh(0, i, a, c)));
          fin = fin && std::isfinite(y);
          double bd = 1e-4 * L + u * (std::abs(x) + L) + (engine ? 2.0 * u * L : 0.0);
          if (fused_bound) bd += 4.0 * u * abs_terms(0, int(map(i)), a, c);
          w = std::fmax(w, std::abs(y - x) / bd);
        }
    return w;
  };
  bool bfin = true;
  const double wq = worst(dq, gr.dq, gr.abs_dq, true, bfin),
               wk = worst(dk, gr.dk, gr.abs_dk, true, bfin),
               wv = worst(dv, gr.dv, gr.abs_dv, true, bfin);
  const double pq = worst(dq_p, gr.dq, gr.abs_dq, false, bfin),
               pk = worst(dk_p, gr.dk, gr.abs_dk, false, bfin),
               pv = worst(dv_p, gr.dv, gr.abs_dv, false, bfin);
  INFO("backward: fused pairs " << bfp.fused << " (pieces " << bfp.fused_pieces << "), portable "
                                << bfp.portable << "; error / bound: dq " << wq << " dk " << wk
                                << " dv " << wv << "; portable_only: dq " << pq << " dk " << pk
                                << " dv " << pv);
  CHECK(bfin);
  CHECK(wq <= 1.0);
  CHECK(wk <= 1.0);
  CHECK(wv <= 1.0);
  CHECK(pq <= 1.0);
  CHECK(pk <= 1.0);
  CHECK(pv <= 1.0);
}

}  // namespace

TEST_CASE("fused path under the distributed schedules (" BLOCKATTN_TEST_PROVIDER ")") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  const int N = 24 * 2 * P;  // a multiple of 2P: every partition
  check<ZigzagPartition, RingSchedule>(comm, CausalMask{}, N, 1);
  check<ZigzagPartition, RingSchedule>(comm, CausalMask{}, N, 1, false, true);  // sinks
  check<StripedPartition, RingSchedule>(comm, CausalMask{}, N, 1);
  check<ContiguousPartition, RingSchedule>(comm, causal_window(20), N, 1);
  check<ContiguousPartition, RingSchedule>(comm, FullMask{}, N + 1, 1);  // uneven pieces
  // Prefix-LM: pairs that straddle the prefix take the kernels in the same call.
  check<ContiguousPartition, RingSchedule>(comm, PrefixLMMask{N / 3}, N, P > 1 ? 1 : 0);
  // The same and a Q ring with the tensor-core backward asked for: on CUDA
  // the pairs that straddle the prefix (own and travelled queries) take it.
  // An odd prefix: at P = 3 N / 3 is a block boundary of both partitions, and
  // no pair would straddle it.
  check<ContiguousPartition, RingSchedule>(comm, PrefixLMMask{N / 3 + 1}, N, P > 1 ? 1 : 0, false,
                                           false, false, true);
  check<ZigzagPartition, BurstSchedule>(comm, PrefixLMMask{N / 3 + 1}, N, -1, false, false, false,
                                        true);
  // Helpers' tasks (another rank's queries): fused as well.
  check<ContiguousPartition, BalancedSchedule>(comm, CausalMask{}, N, 1, P > 2, false, P > 2);
  // BurstAttention: the Q ring's backward, every pair of travelled queries fused.
  check<ZigzagPartition, BurstSchedule>(comm, CausalMask{}, N, 1, false, false, P > 1);
  check<StripedPartition, BurstSchedule>(comm, CausalMask{}, N, 1, false, true, P > 1);
  check<ContiguousPartition, AllGatherSchedule>(comm, CausalMask{}, N, 1);
}

TEST_CASE("fused path under Ulysses and the hybrid (" BLOCKATTN_TEST_PROVIDER ")") {
  // Their local attention goes through the same dispatcher: a causal mask
  // over the whole sequence is one band piece (fused, forward and backward,
  // the backward's dK, dV summed in fp32); a prefix-LM mask is not one piece
  // (cuDNN declines: the tensor-core forward where it is compiled, else the
  // kernels).
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  const int N = 24 * 2 * P;
  for (const Driver d : {Driver::ulysses, Driver::hybrid}) {
    check<ContiguousPartition, RingSchedule>(comm, CausalMask{}, N, 1, false, false, false, false,
                                             d);
    check<ContiguousPartition, RingSchedule>(comm, PrefixLMMask{N / 3 + 1}, N,
                                             d == Driver::ulysses ? 0 : -1, false, false, false,
                                             false, d);
  }
}
