// SPDX-License-Identifier: Apache-2.0
// Single-device forward against the fp64 reference, on this binary's backend.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

enum class Layout { right, strided };

/// Runs one case; returns the error report, after asserting it is within budget.
/// RowMajor: Layout::right is LayoutRight on every backend (otherwise the
/// memory space's default, LayoutLeft on GPUs); tol_scale scales the bound.
template <class T, class Mask, bool RowMajor = false>
ErrorReport run_case(const Shape& s, const Mask& mask, Layout layout, std::uint64_t seed,
                     ForwardOptions opts = {}, double amplitude = 1.0, double tol_scale = 1.0) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, amplitude);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, amplitude);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  using V4 = std::conditional_t<RowMajor, Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>,
                                Kokkos::View<T****, MemSpace>>;
  using V3 = std::conditional_t<RowMajor, Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>,
                                Kokkos::View<T***, MemSpace>>;
  ErrorReport err;
  const double scale = std::isnan(opts.scale) ? 1.0 / std::sqrt(double(s.d)) : opts.scale;
  auto check = [&](const auto& qd, const auto& kd, const auto& vd, const auto& od, const auto& ld) {
    upload(q, qd);
    upload(k, kd);
    upload(v, vd);
    attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
    Kokkos::fence();
    const ReferenceResult ref =
        reference_attention(q, k, v, mask, scale, opts.q_offset, opts.k_offset);
    err = compare(ref, od, ld);
    const double tol = tol_scale * tolerance<T>(ref, s.d, s.nk);
    INFO(describe(s), " layout=", layout == Layout::right ? "right" : "strided", " tol=", tol,
         " o_err=", err.o_err, " lse_err=", err.lse_err);
    CHECK(err.finite);
    CHECK(err.masked_rows_exact);
    CHECK(err.o_err <= tol);
    CHECK(err.lse_err <= tol);
  };
  if (layout == Layout::right) {
    check(V4("q", s.b, s.nq, s.h, s.d), V4("k", s.b, s.nk, s.hkv, s.d),
          V4("v", s.b, s.nk, s.hkv, s.d), V4("o", s.b, s.nq, s.h, s.d), V3("lse", s.b, s.h, s.nq));
  } else {
    // Sub-views of larger allocations: every View is LayoutStride with
    // non-unit strides in heads and head_dim.
    const auto all = Kokkos::ALL;
    const auto heads = std::make_pair(1, 1 + s.h), kv_heads = std::make_pair(1, 1 + s.hkv);
    const auto dims = std::make_pair(0, s.d), rows = std::make_pair(0, s.nq);
    V4 qb("q", s.b, s.nq, s.h + 2, s.d + 3), kb("k", s.b, s.nk, s.hkv + 2, s.d + 3),
        vb("v", s.b, s.nk, s.hkv + 2, s.d + 1), ob("o", s.b, s.nq, s.h + 1, s.d + 2);
    V3 lb("lse", s.b, s.h + 1, s.nq + 5);
    check(Kokkos::subview(qb, all, all, heads, dims), Kokkos::subview(kb, all, all, kv_heads, dims),
          Kokkos::subview(vb, all, all, kv_heads, dims),
          Kokkos::subview(ob, all, all, std::make_pair(0, s.h), dims),
          Kokkos::subview(lb, all, std::make_pair(1, 1 + s.h), rows));
  }
  return err;
}

/// Document starts cutting [0, length) unevenly: 1-token documents, short and
/// long ones, one crossing tile boundaries.
inline std::vector<index_type> document_offsets(index_type length) {
  std::vector<index_type> off{0};
  for (index_type cut : {1, 2, 7, 40, 41, 100, 101, 190})
    if (cut < length) off.push_back(cut);
  off.push_back(length);
  return off;
}

// Lengths around the tile sizes (64x64, and 96x128 at fp32 D = 128, on CPUs; 32 on GPUs), Nq != Nk,
// GQA, and the head dims with compile-time paths (64, 128) and the generic path.
const Shape shapes[] = {
    {1, 1, 1, 1, 1, 64},     {1, 17, 33, 1, 1, 40},   {2, 64, 64, 2, 1, 64},
    {1, 65, 130, 2, 2, 128}, {1, 130, 63, 4, 2, 128}, {2, 100, 200, 2, 1, 8},
    {1, 97, 97, 1, 1, 256},  {1, 33, 129, 3, 3, 200}, {1, 193, 257, 2, 1, 128},
};

}  // namespace

TEST_CASE_TEMPLATE("forward matches the fp64 reference for every mask and layout", T,
                   BLOCKATTN_TEST_TYPES) {
  std::uint64_t seed = 1;
  for (const Shape& s : shapes)
    for (Layout layout : {Layout::right, Layout::strided}) {
      ++seed;
      run_case<T>(s, FullMask{}, layout, seed);
      run_case<T>(s, CausalMask{}, layout, seed);
      run_case<T>(s, SlidingWindowMask{20, 5}, layout, seed);
      run_case<T>(s, causal_window(70), layout, seed);
      run_case<T>(s, PrefixLMMask{40}, layout, seed);
      // Packed documents of uneven lengths (1-token ones too), offsets in the
      // backend's memory: causal, and bidirectional within a window.
      const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
      run_case<T>(s, docs.mask(), layout, seed);
      run_case<T>(s, docs.mask(false, 20, 5), layout, seed);
    }
}

TEST_CASE("fp32 on CUDA tensor cores (ForwardOptions::fp32_tensor_cores), every mask") {
  // CUDA: the fp32 forward on TF32 products (kernel/cuda/flash_forward_f32.hpp)
  // where it takes the call (head dims 64 and 128, aligned contiguous rows,
  // finite inputs). Elsewhere the option changes nothing: skipped (and not
  // compiled).
  if constexpr (!impl::flash_f32_enabled<ExecSpace, float, FullMask>()) {
    MESSAGE("SKIPPED: no fp32 tensor-core forward on this backend");
  } else {
    // Tolerances: the fp32 bound (forward_check.hpp) with the products' unit
    // 2^-20 (tf32x3: three TF32 products, ~2^-22 each, 4x margin) or 2^-10
    // (tf32: 10-bit mantissas) in place of fp32's 2^-23.
    const Fp32TensorCores modes[] = {Fp32TensorCores::tf32x3, Fp32TensorCores::tf32};
    std::uint64_t seed = 900;
    for (const Fp32TensorCores mode : modes) {
      const double tol_scale = mode == Fp32TensorCores::tf32x3 ? 8.0 : 8192.0;
      for (const Shape& s : shapes) {
        const bool takes = s.d == 64 || s.d == 128;
        for (Layout layout : {Layout::right, Layout::strided}) {
          ++seed;
          BlockPathCounts paths;
          ForwardOptions opts;
          opts.fp32_tensor_cores = mode;
          opts.paths = &paths;
          run_case<float, FullMask, true>(s, FullMask{}, layout, seed, opts, 1.0, tol_scale);
          run_case<float, CausalMask, true>(s, CausalMask{}, layout, seed, opts, 1.0, tol_scale);
          run_case<float, SlidingWindowMask, true>(s, SlidingWindowMask{20, 5}, layout, seed, opts,
                                                   1.0, tol_scale);
          run_case<float, PrefixLMMask, true>(s, PrefixLMMask{40}, layout, seed, opts, 1.0,
                                              tol_scale);
          const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
          run_case<float, DocumentMask, true>(s, docs.mask(), layout, seed, opts, 1.0, tol_scale);
          // Strided rows (not 16-byte aligned) are not the kernel's: the fp32 kernels took them.
          INFO(describe(s), " matrix=", paths.matrix, " portable=", paths.portable);
          CHECK(paths.matrix == (takes && layout == Layout::right ? 5 : 0));
        }
      }
    }
    // Rows that see no key, through offsets.
    ForwardOptions opts;
    opts.fp32_tensor_cores = Fp32TensorCores::tf32x3;
    opts.k_offset = 100;
    const ErrorReport e = run_case<float, CausalMask, true>({1, 180, 70, 2, 1, 64}, CausalMask{},
                                                            Layout::right, 9, opts, 1.0, 8.0);
    CHECK(e.masked_rows == 2 * 100);
    // A NaN in q: the call takes the fp32 kernels (NaN exactly where visible).
    using V4 = Kokkos::View<float****, Kokkos::LayoutRight, MemSpace>;
    using V3 = Kokkos::View<float***, Kokkos::LayoutRight, MemSpace>;
    V4 q("q", 1, 70, 2, 64), k("k", 1, 70, 2, 64), v("v", 1, 70, 2, 64), o("o", 1, 70, 2, 64);
    V3 lse("lse", 1, 2, 70);
    Kokkos::deep_copy(q, 0.5f);
    Kokkos::deep_copy(k, 0.25f);
    Kokkos::deep_copy(v, 1.0f);
    Kokkos::deep_copy(Kokkos::subview(q, 0, 30, 1, 3), std::numeric_limits<float>::quiet_NaN());
    BlockPathCounts paths;
    opts = {};
    opts.fp32_tensor_cores = Fp32TensorCores::tf32x3;
    opts.paths = &paths;
    attention_forward(ExecSpace{}, q, k, v, o, lse, CausalMask{}, opts);
    Kokkos::fence();
    CHECK(paths.matrix == 0);
    const auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, lse);
    CHECK(std::isnan(lh(0, 1, 30)));
    CHECK(std::isfinite(lh(0, 0, 30)));
    CHECK(std::isfinite(lh(0, 1, 31)));
  }
}

TEST_CASE_TEMPLATE("masks see global positions through the offsets", T, BLOCKATTN_TEST_TYPES) {
  // Queries are the last rows of a longer sequence (a decode-like chunk).
  ForwardOptions opts;
  opts.q_offset = 150;
  run_case<T>({1, 50, 200, 2, 1, 64}, CausalMask{}, Layout::right, 7, opts);
  opts.q_offset = 1000;
  opts.k_offset = 990;
  run_case<T>({1, 70, 90, 1, 1, 128}, SlidingWindowMask{16, 16}, Layout::strided, 8, opts);
}

TEST_CASE_TEMPLATE("fully masked rows give O = 0 and LSE = -inf, never NaN", T,
                   BLOCKATTN_TEST_TYPES) {
  // Keys start at global position 100: causal queries 0..99 see nothing; rows
  // 100.. see some keys. Mixed tiles exercise the per-row guard.
  ForwardOptions opts;
  opts.k_offset = 100;
  const ErrorReport e = run_case<T>({1, 180, 70, 2, 1, 64}, CausalMask{}, Layout::right, 9, opts);
  CHECK(e.masked_rows == 2 * 100);
  // A band that excludes everything: every row is masked.
  const ErrorReport all =
      run_case<T>({1, 40, 40, 1, 1, 40}, SlidingWindowMask{-50, 60}, Layout::strided, 10);
  CHECK(all.masked_rows == 40);
}

TEST_CASE_TEMPLATE("logits of magnitude 1e4 stay finite and exact", T, BLOCKATTN_TEST_TYPES) {
  // q, k with entries up to 30 and D = 128: |scale * q.k| reaches ~1e4.
  ForwardOptions opts;
  opts.scale = 1.0;
  const Shape s{1, 70, 130, 1, 1, 128};
  std::mt19937_64 rng(11);
  for (auto mask_case = 0; mask_case < 2; ++mask_case) {
    const ErrorReport e = mask_case == 0
                              ? run_case<T>(s, FullMask{}, Layout::right, 11, opts, 30.0)
                              : run_case<T>(s, CausalMask{}, Layout::right, 12, opts, 30.0);
    CHECK(e.finite);
  }
  // And the reference really had such logits.
  HostTensor q = random_tensor(1, 70, 1, 128, rng, 30.0),
             k = random_tensor(1, 130, 1, 128, rng, 30.0);
  const ReferenceResult ref = reference_attention(q, k, k, FullMask{}, 1.0);
  CHECK(ref.max_abs_logit > 5e3);
}

namespace {

/// How a test cuts the queries into team tiles (impl::QueryTiles): `rows`
/// micro-tile rows per tile (0: block_q rows), or with `even`, the fewest tiles
/// of at most block_q rows plus `extra` more, of (nearly) equal height.
struct TileSplit {
  int rows = 0;
  bool even = false;
  int extra = 0;
};

/// Runs launch_forward with position maps qpos, kpos and the query tiles
/// `split`; O and LSE on the host.
template <class T, class Mask, class QPos, class KPos>
std::pair<std::vector<T>, std::vector<T>> forward_with_positions(const Shape& s, const Mask& mask,
                                                                 const QPos& qpos, const KPos& kpos,
                                                                 TileSplit split,
                                                                 std::uint64_t seed) {
  using mem = MemSpace;
  using TS = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, mem>;
  using V3 = Kokkos::View<T***, Kokkos::LayoutRight, mem>;
  V4 qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d), vd("v", s.b, s.nk, s.hkv, s.d),
      od("o", s.b, s.nq, s.h, s.d);
  V3 ld("lse", s.b, s.h, s.nq);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  ExecSpace exec;
  const impl::ForwardExtents e{s.b, s.h, s.hkv, s.nq, s.nk, s.d};
  const T scale = T(1) / std::sqrt(T(s.d));
  impl::with_shape_for<TS>(s.d, [&](auto static_d, auto shape) {
    constexpr int SD = decltype(static_d)::value;
    using S = decltype(shape);
    using Kernel = impl::ForwardKernel<ExecSpace, T, SD, S, Mask, QPos, KPos>;
    auto kv = impl::allocate_forward_kv<T, mem, S, SD>(s.b, s.hkv, s.nk, Kernel::pad_dim(s.d));
    impl::pack_kv(exec, kd, vd, kv);
    impl::BlockStep<T, mem> step;
    constexpr int MR = S::micro_rows, BQ = S::block_q;
    if (split.even) {
      const int groups = (s.nq + MR - 1) / MR;
      const int fewest = (groups + BQ / MR - 1) / (BQ / MR);
      step.query_tiles = impl::QueryTiles::even(s.nq, std::min(groups, fewest + split.extra), MR);
    } else if (split.rows > 0) {
      step.query_tiles = impl::QueryTiles::rows(s.nq, std::min(BQ, split.rows * MR), MR);
    }
    impl::launch_forward<ExecSpace, T, SD, S>(exec, e, qd, kv, od, ld, mask, qpos, kpos, scale,
                                              step);
  });
  exec.fence();
  auto oh = to_host(od);
  auto lh = to_host(ld);
  return {std::vector<T>(oh.data(), oh.data() + oh.span()),
          std::vector<T>(lh.data(), lh.data() + lh.span())};
}

/// The same with offset maps (queries from q_offset, keys from 0).
template <class T, class Mask>
std::pair<std::vector<T>, std::vector<T>> forward_with_tiles(const Shape& s, const Mask& mask,
                                                             index_type q_offset, TileSplit split,
                                                             std::uint64_t seed) {
  return forward_with_positions<T>(s, mask, OffsetPositions{q_offset}, OffsetPositions{0}, split,
                                   seed);
}

/// An offset map that counts the reads outside its n rows (a table of
/// positions ends at its last row: the kernels must not read past it).
struct CountingPositions {
  index_type offset = 0;
  index_type rows = 0;
  int* outside = nullptr;  // one counter in the execution space's memory
  KOKKOS_INLINE_FUNCTION index_type operator()(index_type i) const {
    if (i < 0 || i >= rows) Kokkos::atomic_fetch_add(outside, 1);
    return offset + i;
  }
};

/// Same values (an exact zero of either sign counts as equal), NaN where NaN.
template <class T>
int count_differences(const std::vector<T>& a, const std::vector<T>& b) {
  int n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += !(a[i] == b[i] || (a[i] != a[i] && b[i] != b[i]));
  return n;
}

/// Stands in for a tile shape in balanced_query_tiles (it reads only these two).
struct Rows96 {
  static constexpr int block_q = 96, micro_rows = 6;
};

/// Rows of each query tile of `split` (MR rows per micro-row group).
std::vector<int> tile_heights(const impl::QueryTiles& split, int queries, int mr) {
  std::vector<int> h;
  for (int qt = 0; qt < split.tiles; ++qt)
    h.push_back(split.end(qt, mr, queries) - split.begin(qt, mr));
  return h;
}

}  // namespace

TEST_CASE_TEMPLATE("query tiles of any height give the same O and LSE", T, BLOCKATTN_TEST_TYPES) {
  // The forward spreads few query tiles over threads by cutting the queries
  // into more, shorter tiles (balanced_query_tiles). Each row's sums run over
  // the same key tiles in the same order whatever tile holds the row, so O and
  // LSE must not change.
  const Shape shapes_rows[] = {
      {1, 200, 150, 2, 1, 64}, {2, 97, 130, 2, 2, 40}, {1, 1, 65, 1, 1, 128}};
  const TileSplit splits[] = {{1}, {2}, {5}, {9}, {0, true, 0}, {0, true, 1}, {0, true, 4}};
  std::uint64_t seed = 40;
  for (const Shape& s : shapes_rows) {
    ++seed;
    const Documents<MemSpace> docs(document_offsets(s.nq + 30));
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind)
      for (const TileSplit& split : splits) {
        INFO(describe(s), " mask=", mask_kind, " tile rows=", split.rows,
             " micro rows; even=", split.even, " extra=", split.extra);
        auto run = [&](TileSplit t) {
          if (mask_kind == 0) return forward_with_tiles<T>(s, FullMask{}, 0, t, seed);
          if (mask_kind == 1) return forward_with_tiles<T>(s, CausalMask{}, 30, t, seed);
          return forward_with_tiles<T>(s, docs.mask(), 30, t, seed);
        };
        const auto whole = run({}), shorter = run(split);
        CHECK(count_differences(whole.first, shorter.first) == 0);
        CHECK(count_differences(whole.second, shorter.second) == 0);
      }
  }
}

TEST_CASE_TEMPLATE("the forward reads position maps only at its own rows", T,
                   BLOCKATTN_TEST_TYPES) {
  // Row counts that leave partial micro tiles and partial key tiles; a mask
  // with allowed_keys (row ranges) and one without (allowed() per pair). O and
  // LSE must equal those of plain offset maps, and no position outside the
  // rows may be read.
  const Shape shapes[] = {{1, 97, 130, 2, 1, 64}, {2, 7, 61, 1, 1, 40}, {1, 1, 65, 1, 1, 128}};
  Kokkos::View<int, MemSpace> outside("outside");
  std::uint64_t seed = 70;
  for (const Shape& s : shapes) {
    ++seed;
    for (int mask_kind = 0; mask_kind < 2; ++mask_kind) {
      INFO(describe(s), " mask=", mask_kind);
      Kokkos::deep_copy(outside, 0);
      const CountingPositions qpos{30, s.nq, outside.data()}, kpos{0, s.nk, outside.data()};
      auto both = [&](const auto& mask) {
        return std::make_pair(forward_with_positions<T>(s, mask, qpos, kpos, {}, seed),
                              forward_with_tiles<T>(s, mask, 30, {}, seed));
      };
      const auto r = mask_kind == 0 ? both(CausalMask{}) : both(DocumentCausalMask{11});
      CHECK(count_differences(r.first.first, r.second.first) == 0);
      CHECK(count_differences(r.first.second, r.second.second) == 0);
      int reads_outside = -1;
      Kokkos::deep_copy(reads_outside, outside);
      CHECK(reads_outside == 0);
    }
  }
}

TEST_CASE("balanced_query_tiles: other query tiles only when they finish sooner") {
  impl::ForwardExtents e{1, 1, 1, 1024, 1024, 64};
  for (bool rows_are_work : {true, false}) {
    INFO("rows_are_work=", rows_are_work);
    // 1 thread: tiles of block_q rows.
    e.queries = 1024;
    e.heads = 1;
    CHECK(impl::balanced_query_tiles<Rows96>(e, 1, rows_are_work).tiles == 0);
    // Many: as many tiles, of (nearly) equal height where rows are work.
    e.heads = 16;
    const impl::QueryTiles many = impl::balanced_query_tiles<Rows96>(e, 2, rows_are_work);
    CHECK(many.tiles == (rows_are_work ? 11 : 0));
    if (rows_are_work)
      CHECK(tile_heights(many, 1024, 6) ==
            std::vector<int>{90, 96, 90, 96, 90, 96, 90, 96, 90, 96, 94});
    // N = 1024 on 2 threads: 11 tiles of 96 rows are 6 + 5 (544 rows vs 480).
    // Rows as work: 171 groups of 6 rows over 12 tiles of 14 or 15 groups.
    // Otherwise 13 tiles of 84 rows, the last 16 (7 + 6 tiles, 520 and 504 rows).
    e.heads = 1;
    impl::QueryTiles split = impl::balanced_query_tiles<Rows96>(e, 2, rows_are_work);
    std::vector<int> h = tile_heights(split, e.queries, 6);
    CHECK(std::accumulate(h.begin(), h.end(), 0) == 1024);
    for (std::size_t t = 0; t + 1 < h.size(); ++t) CHECK(h[t] % 6 == 0);
    if (rows_are_work) {
      CHECK(split.tiles == 12);
      CHECK(*std::min_element(h.begin(), h.end()) >= 84);
      CHECK(*std::max_element(h.begin(), h.end()) == 90);
      CHECK(h.back() == 88);  // the last tile ends at the last query
    } else {
      CHECK(split.tiles == 13);
      CHECK(std::count(h.begin(), h.end(), 84) == 12);
      CHECK(h.back() == 16);
    }
    // A sequence that already splits evenly keeps block_q: 8 tiles of 96 on 4 threads.
    e.queries = 768;
    CHECK(impl::balanced_query_tiles<Rows96>(e, 4, rows_are_work).tiles == 0);
    // Shorter than one tile on 2 threads: two tiles, 48 and 42 rows.
    e.queries = 90;
    split = impl::balanced_query_tiles<Rows96>(e, 2, rows_are_work);
    CHECK(tile_heights(split, e.queries, 6) == std::vector<int>{48, 42});
    // Never a tile above block_q or below half of it (bar the last): N = 1000..1100, 2..5 threads.
    for (int n = 1000; n <= 1100; ++n)
      for (int threads = 2; threads <= 5; ++threads) {
        e.queries = n;
        split = impl::balanced_query_tiles<Rows96>(e, threads, rows_are_work).resolved(n, 96, 6);
        h = tile_heights(split, n, 6);
        INFO("N=", n, " threads=", threads);
        CHECK(std::accumulate(h.begin(), h.end(), 0) == n);
        CHECK(*std::max_element(h.begin(), h.end()) <= 96);
        CHECK(*std::min_element(h.begin(), h.end() - 1) >= 48);
      }
  }
}

TEST_CASE("balanced_query_tiles: the matrix engine's tiles are whole 32-row blocks") {
  // The host matrix engine computes query rows in blocks of 32: a tile of 84
  // rows costs it 96. Its splits cut at multiples of 32 rows (granule 32),
  // never above block_q.
  impl::ForwardExtents e{1, 1, 1, 1024, 1024, 64};
  for (bool rows_are_work : {true, false}) {
    INFO("rows_are_work=", rows_are_work);
    // N = 1024 on 2 threads: where rows are work, 12 tiles of 64 or 96 rows
    // (16 blocks per thread); on a causal diagonal tiles of block_q (the
    // fp32 kernels' split is 13 tiles of 84 rows there).
    impl::QueryTiles split = impl::balanced_query_tiles(e, 96, 6, 2, rows_are_work, true);
    if (rows_are_work) {
      CHECK(split.tiles == 12);
      CHECK(split.granule == 32);
      std::vector<int> h = tile_heights(split, 1024, 6);
      CHECK(std::accumulate(h.begin(), h.end(), 0) == 1024);
      CHECK(std::count(h.begin(), h.end(), 64) == 4);
      CHECK(std::count(h.begin(), h.end(), 96) == 8);
    } else {
      CHECK(split.tiles == 0);  // tiles of block_q rows
    }
    CHECK(impl::balanced_query_tiles(e, 96, 6, 2, rows_are_work, false).tiles ==
          (rows_are_work ? 12 : 13));
    // 1 thread: tiles of block_q rows, as for the fp32 kernels.
    CHECK(impl::balanced_query_tiles(e, 96, 6, 1, rows_are_work, true).tiles == 0);
    // Any length and thread count: whole blocks bar the last tile, at most
    // block_q rows, covering the queries.
    for (int n = 1; n <= 1100; n += 13)
      for (int threads = 2; threads <= 5; ++threads) {
        e.queries = n;
        INFO("N=", n, " threads=", threads);
        split =
            impl::balanced_query_tiles(e, 96, 6, threads, rows_are_work, true).resolved(n, 96, 6);
        const std::vector<int> h = tile_heights(split, n, 6);
        CHECK(std::accumulate(h.begin(), h.end(), 0) == n);
        CHECK(*std::max_element(h.begin(), h.end()) <= 96);
        for (std::size_t t = 0; t + 1 < h.size(); ++t) CHECK(h[t] % 32 == 0);
      }
    e.queries = 1024;
  }
}

TEST_CASE_TEMPLATE("k and v in LayoutLeft pack to the same block as LayoutRight", T,
                   BLOCKATTN_TEST_TYPES) {
  // pack_kv reads rows through their stride: a column-major K and V (head-dim
  // stride = batch x seq x heads) give bitwise the results of row-major ones.
  const Shape s{2, 70, 150, 2, 1, 40};
  std::mt19937_64 rng(5);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  using VR = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
  using VL = Kokkos::View<T****, Kokkos::LayoutLeft, MemSpace>;
  using V3 = Kokkos::View<T***, MemSpace>;
  VR qd("q", s.b, s.nq, s.h, s.d), kr("k", s.b, s.nk, s.hkv, s.d), vr("v", s.b, s.nk, s.hkv, s.d),
      o1("o1", s.b, s.nq, s.h, s.d), o2("o2", s.b, s.nq, s.h, s.d);
  VL kl("kl", s.b, s.nk, s.hkv, s.d), vl("vl", s.b, s.nk, s.hkv, s.d);
  V3 l1("l1", s.b, s.h, s.nq), l2("l2", s.b, s.h, s.nq);
  upload(q, qd);
  upload(k, kr);
  upload(v, vr);
  upload(k, kl);
  upload(v, vl);
  attention_forward(ExecSpace{}, qd, kr, vr, o1, l1, CausalMask{});
  attention_forward(ExecSpace{}, qd, kl, vl, o2, l2, CausalMask{});
  Kokkos::fence();
  auto h1 = to_host(o1), h2 = to_host(o2);
  auto g1 = to_host(l1), g2 = to_host(l2);
  CHECK(count_differences(std::vector<T>(h1.data(), h1.data() + h1.span()),
                          std::vector<T>(h2.data(), h2.data() + h2.span())) == 0);
  CHECK(count_differences(std::vector<T>(g1.data(), g1.data() + g1.span()),
                          std::vector<T>(g2.data(), g2.data() + g2.span())) == 0);
  const ReferenceResult ref = reference_attention(q, k, v, CausalMask{}, 1.0 / std::sqrt(40.0));
  const ErrorReport err = compare(ref, o2, l2);
  CHECK(err.o_err <= tolerance<T>(ref, s.d, s.nk));
  CHECK(err.lse_err <= tolerance<T>(ref, s.d, s.nk));
}

namespace {
struct DeviceLikeSpace {};  // a memory space other than HostSpace
}  // namespace

// The forward kernel's packed K/V layout per space: panels as wide as the micro
// tile on host spaces (one micro tile streams one contiguous panel), the whole
// tile on devices (adjacent threads read adjacent values of a row: coalesced).
// Micro-tile panels on the H100 made the forward 4x slower.
TEST_CASE("forward K/V panels: micro tile wide on host spaces, the whole tile on devices") {
  using Dev = DefaultTileShape<float, false, 128>;
  using DevP = impl::ForwardPanels<DeviceLikeSpace, Dev, 128>;
  CHECK(DevP::kt == Dev::block_k);
  CHECK(DevP::v(128) == 128);
  CHECK(impl::ForwardPanels<DeviceLikeSpace, DefaultTileShape<float, false>, 0>::v(40) == 40);
  using Host = impl::shape_for_head_dim_t<DefaultTileShape<float, true>, 128>;
  using HostP = impl::ForwardPanels<Kokkos::HostSpace, Host, 128>;
  CHECK(HostP::kt == Host::micro_cols);
  CHECK(HostP::v(128) == impl::forward_v_panel<Host, 128>);
  using HostG = DefaultTileShape<double, true>;
  CHECK(impl::ForwardPanels<Kokkos::HostSpace, HostG, 0>::v(40) == HostG::dim_granule);
  // allocate_forward_kv records the widths the kernel reads with.
  const auto kv = impl::allocate_forward_kv<float, Kokkos::HostSpace, Host, 128>(1, 1, 100, 128);
  CHECK(kv.panel == HostP::kt);
  CHECK(kv.v_panel == HostP::v(128));
}

TEST_CASE_TEMPLATE("pack_kv writes bitwise the block of the one-key-per-thread pack", T,
                   BLOCKATTN_TEST_TYPES) {
  // On host spaces pack_kv packs groups of 16 or 8 keys of a panel (K^T rows
  // written G keys at a time); pack_kv_rows is the device path (one key per
  // thread). Both buffers start as NaN, so a padding element (keys past the
  // end, head-dim columns past dim) one of them leaves unwritten shows up.
  // Panels of 64 / 32 / 16 keys take groups of 16, 24 and 8 groups of 8, 12
  // the row path; 150 keys end inside a group and inside a tile; sources
  // in LayoutRight and LayoutLeft.
  using VR = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
  using VL = Kokkos::View<T****, Kokkos::LayoutLeft, MemSpace>;
  const int b = 2, nk = 150, hkv = 3, d = 40, dim_padded = 48;
  std::mt19937_64 rng(11);
  HostTensor k = random_tensor(b, nk, hkv, d, rng);
  HostTensor v = random_tensor(b, nk, hkv, d, rng);
  VR kr("k", b, nk, hkv, d), vr("v", b, nk, hkv, d);
  VL kl("kl", b, nk, hkv, d), vl("vl", b, nk, hkv, d);
  upload(k, kr);
  upload(v, vr);
  upload(k, kl);
  upload(v, vl);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // (The packed views are contiguous, LayoutRight.)
  auto host = [](const auto& view) {
    return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  };
  auto bits = [&](const auto& view) {
    auto h = host(view);
    std::vector<unsigned char> out(h.span() * sizeof(T));
    std::memcpy(out.data(), h.data(), out.size());
    return out;
  };
  struct Blocking {
    int block_k, panel, v_panel;
  };
  // {32, 32, 48}: the devices' forward layout (one panel per tile).
  for (const Blocking& bl :
       {Blocking{128, 64, 16}, Blocking{192, 64, 48}, Blocking{64, 32, 16}, Blocking{96, 24, 8},
        Blocking{48, 16, 48}, Blocking{96, 12, 16}, Blocking{32, 32, 48}})
    for (const bool left : {false, true}) {
      INFO("block_k=", bl.block_k, " panel=", bl.panel, " v_panel=", bl.v_panel,
           " layout=", std::string(left ? "left" : "right"));
      auto grouped = impl::allocate_packed_kv<T, MemSpace>(b, hkv, nk, dim_padded, bl.block_k,
                                                           bl.panel, bl.v_panel);
      auto rows = impl::allocate_packed_kv<T, MemSpace>(b, hkv, nk, dim_padded, bl.block_k,
                                                        bl.panel, bl.v_panel);
      for (auto* p : {&grouped, &rows}) {
        Kokkos::deep_copy(p->kt, nan);
        Kokkos::deep_copy(p->v, nan);
      }
      if (left) {
        impl::pack_kv(ExecSpace{}, kl, vl, grouped);
        impl::pack_kv_rows(ExecSpace{}, kl, vl, rows);
      } else {
        impl::pack_kv(ExecSpace{}, kr, vr, grouped);
        impl::pack_kv_rows(ExecSpace{}, kr, vr, rows);
      }
      Kokkos::fence();
      const auto kt_rows = bits(rows.kt), v_rows = bits(rows.v);
      CHECK(bits(grouped.kt) == kt_rows);
      CHECK(bits(grouped.v) == v_rows);
      // The row path itself: no element left unwritten (NaN), and K^T element
      // (d, c) / V row c of the last tile (partial: padding keys) where
      // kt_tile_offset and v_tile_offset put them.
      auto kth = host(rows.kt);
      auto vh = host(rows.v);
      int unwritten = 0, misplaced = 0;
      for (std::size_t i = 0; i < kth.span(); ++i) unwritten += kth.data()[i] != kth.data()[i];
      for (std::size_t i = 0; i < vh.span(); ++i) unwritten += vh.data()[i] != vh.data()[i];
      const int last = (nk - 1) / bl.block_k;
      const T* kt_tile = &kth(1, 2, last, 0, 0);
      const T* v_tile = &vh(1, 2, last * bl.block_k, 0);
      for (int c = 0; c < bl.block_k; ++c)
        for (int dd = 0; dd < dim_padded; ++dd) {
          const int n = last * bl.block_k + c;
          const T want_k = n < nk && dd < d ? T(k(1, n, 2, dd)) : T(0);
          const T want_v = n < nk && dd < d ? T(v(1, n, 2, dd)) : T(0);
          misplaced += kt_tile[impl::kt_tile_offset(dd, c, dim_padded, bl.panel)] != want_k;
          misplaced += v_tile[impl::v_tile_offset(c, dd, bl.block_k, bl.v_panel)] != want_v;
        }
      CHECK(unwritten == 0);
      CHECK(misplaced == 0);
    }
}
