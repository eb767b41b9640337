// SPDX-License-Identifier: Apache-2.0
// Single-device forward against the fp64 reference, on this binary's backend.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <random>
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
template <class T, class Mask>
ErrorReport run_case(const Shape& s, const Mask& mask, Layout layout, std::uint64_t seed,
                     ForwardOptions opts = {}, double amplitude = 1.0) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, amplitude);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, amplitude);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  using V4 = Kokkos::View<T****, MemSpace>;
  using V3 = Kokkos::View<T***, MemSpace>;
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
    const double tol = tolerance<T>(ref, s.d, s.nk);
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

TEST_CASE_TEMPLATE("forward matches the fp64 reference for every mask and layout", T, float,
                   double) {
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

TEST_CASE_TEMPLATE("masks see global positions through the offsets", T, float, double) {
  // Queries are the last rows of a longer sequence (a decode-like chunk).
  ForwardOptions opts;
  opts.q_offset = 150;
  run_case<T>({1, 50, 200, 2, 1, 64}, CausalMask{}, Layout::right, 7, opts);
  opts.q_offset = 1000;
  opts.k_offset = 990;
  run_case<T>({1, 70, 90, 1, 1, 128}, SlidingWindowMask{16, 16}, Layout::strided, 8, opts);
}

TEST_CASE_TEMPLATE("fully masked rows give O = 0 and LSE = -inf, never NaN", T, float, double) {
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

TEST_CASE_TEMPLATE("logits of magnitude 1e4 stay finite and exact", T, float, double) {
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
