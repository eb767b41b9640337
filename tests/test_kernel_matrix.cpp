// SPDX-License-Identifier: Apache-2.0
// Every block product the library can precompile, run once against the fp64
// reference: each built-in mask x position map (AffinePositions: single
// device and the contiguous, striped and zigzag partitions; TablePositions:
// TablePartition) x direction x value types of kernel/instantiate.hpp, on
// this binary's host backend (BLOCKATTN_TEST_BACKEND).
//
// The other suites reach these kernels through the layers above them and
// call only some (tests/kernels_used.txt lists which: e.g. 16-bit backward
// on the first host backend only, TablePartition backward in fp64). Here
// each is called directly through the block-product seam
// (kernel/block_product.hpp), as the step loops call it: the forward over
// two key blocks (the second resumes the first's softmax state, 16-bit
// outputs through the fp32 accumulator), the backward over one pair. What
// BlockAttn::kernels precompiles (BLOCKATTN_KERNELS_SET) runs from the
// library; what it leaves out is compiled in this file.
//
// Positions: queries in two affine pieces (rows 0..19 at 0..19, the rest at
// 100..), keys at stride 2 in two pieces; or, for the table, random sorted
// positions in [0, 180) with position 0 a query and not a key. Rows that see
// no key (O = 0, LSE = -inf, checked exactly) are there under the causal and
// document masks by construction, under others where the positions give them.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class S>
using V4 = Kokkos::View<S****, Kokkos::LayoutRight, MemSpace>;
template <class T>
using L3 = Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>;

template <class S>
const char* type_name() {
  if (std::is_same<S, double>::value) return "fp64";
  if (std::is_same<S, float>::value) return "fp32";
  return std::is_same<S, bf16>::value ? "bf16" : "fp16";
}

template <class S>
constexpr bool is_16bit_v = std::is_same<S, bf16>::value || std::is_same<S, fp16>::value;

/// The unit roundoff of storing into S (0: S holds the compute type's values).
template <class S>
double roundoff() {
  if constexpr (is_16bit_v<S>)
    return S::unit_roundoff;
  else
    return 0.0;
}

/// Bound on |fl_S(x~) - x| when x~ is within e of x: e, or rounded_bound
/// (forward_check.hpp) for a 16-bit S.
template <class S>
double stored_bound(double e, double x) {
  if constexpr (is_16bit_v<S>)
    return rounded_bound<S>(e, x);
  else
    return e;
}

constexpr int kBlock1 = 35;  // keys of the forward's first block; 70 in all
constexpr int kKeys = 70;
constexpr int kQueries = 45;

/// One position map kind: the maps of the queries, of both key blocks and of
/// all keys (the backward's one block), and the positions themselves.
struct AffineMaps {
  static constexpr const char* name = "Affine";
  AffinePositions q{20, 0, 100, 1};
  AffinePositions k1{index_type(1) << 62, 5, 0, 2};
  AffinePositions k2{index_type(1) << 62, 110, 0, 2};
  AffinePositions k{kBlock1, 5, 110, 2};
  int b = 1, h = 4, hkv = 2, d = 64;
};

struct TableMaps {
  static constexpr const char* name = "Table";
  Kokkos::View<index_type*, MemSpace> qv, kv;
  typename Kokkos::View<index_type*, MemSpace>::HostMirror qh, kh;
  TablePositions q, k1, k2, k;
  int b = 2, h = 2, hkv = 1, d = 40;

  TableMaps() {
    std::mt19937_64 rng(20261203);
    std::vector<index_type> all(179);
    for (int i = 0; i < 179; ++i) all[std::size_t(i)] = i + 1;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<index_type> qs(all.begin(), all.begin() + kQueries - 1);
    qs.push_back(0);  // a query before every key
    // Increasing, as a TablePartition rank's (the kernels classify tiles by
    // their first and last positions): the backward's block, and the
    // forward's two blocks (two ranks) its halves.
    std::vector<index_type> ks(all.begin() + kQueries, all.begin() + kQueries + kKeys);
    std::sort(qs.begin(), qs.end());
    std::sort(ks.begin(), ks.end());
    qv = decltype(qv)("q_positions", kQueries);
    kv = decltype(kv)("k_positions", kKeys);
    qh = Kokkos::create_mirror_view(qv);
    kh = Kokkos::create_mirror_view(kv);
    for (int i = 0; i < kQueries; ++i) qh(i) = qs[std::size_t(i)];
    for (int j = 0; j < kKeys; ++j) kh(j) = ks[std::size_t(j)];
    Kokkos::deep_copy(qv, qh);
    Kokkos::deep_copy(kv, kh);
    q = {qh.data(), qv.data()};
    k = {kh.data(), kv.data()};
    k1 = k;
    k2 = {kh.data() + kBlock1, kv.data() + kBlock1};
  }
};

/// allowed(qpos(i), kpos(j)) of every pair, for the reference.
template <class Mask, class Maps>
ReferenceMask pair_mask(const Mask& mask, const Maps& m) {
  ReferenceMask r;
  r.nq = kQueries;
  r.nk = kKeys;
  r.allowed.resize(std::size_t(kQueries) * kKeys);
  for (int i = 0; i < kQueries; ++i)
    for (int j = 0; j < kKeys; ++j)
      r.allowed[std::size_t(i) * kKeys + j] = mask.allowed(m.q(i), m.k(j)) ? 1 : 0;
  return r;
}

double max_abs(const HostTensor& t) {
  double x = 0.0;
  for (double v : t.data) x = std::max(x, std::abs(v));
  return x;
}

/// The forward block product (T, QS, OS): queries stored as QS (K and V too),
/// output O stored as OS, over the two key blocks.
template <class T, class QS, class OS, class Mask, class Maps>
void check_forward(const Mask& mask, const Maps& m, std::uint64_t seed) {
  const int b = m.b, h = m.h, hkv = m.hkv, d = m.d;
  const std::string what = std::string("forward ") + Maps::name + " T=" + type_name<T>() +
                           " q/k/v=" + type_name<QS>() + " o=" + type_name<OS>() +
                           " D=" + std::to_string(d);
  INFO(what);
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(b, kQueries, h, d, rng), k = random_tensor(b, kKeys, hkv, d, rng),
             v = random_tensor(b, kKeys, hkv, d, rng);
  V4<QS> qd("q", b, kQueries, h, d), kd("k", b, kKeys, hkv, d), vd("v", b, kKeys, hkv, d);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  V4<OS> od("o", b, kQueries, h, d);
  L3<T> ld("lse", b, h, kQueries);
  const T scale = T(1) / std::sqrt(T(d));
  const BlockExtents e1{b, h, hkv, kQueries, kBlock1, d},
      e2{b, h, hkv, kQueries, kKeys - kBlock1, d};
  const BlockLayout layout = forward_layout<T, ExecSpace>(d);
  ForwardBlockState<T, MemSpace> state;
  state.state = SoftmaxState<T, MemSpace>(b, h, kQueries);
  if constexpr (!std::is_same<OS, T>::value) state.o_acc = V4<T>("o_acc", b, kQueries, h, d);
  const auto all = Kokkos::ALL;
  const std::pair<int, int> keys[2] = {{0, kBlock1}, {kBlock1, kKeys}};
  for (int blk = 0; blk < 2; ++blk) {
    const BlockExtents& e = blk == 0 ? e1 : e2;
    const auto kv = allocate_forward_block<T, ExecSpace>(layout, b, hkv, e.keys);
    pack_forward_block(ExecSpace{}, Kokkos::subview(kd, all, keys[blk], all, all),
                       Kokkos::subview(vd, all, keys[blk], all, all), kv);
    ForwardBlockState<T, MemSpace> s = state;
    s.resume = blk == 1;
    s.finish = blk == 1;
    forward_block(ExecSpace{}, e, qd, kv, od, ld, mask, m.q, blk == 0 ? m.k1 : m.k2, scale, s);
  }
  Kokkos::fence();

  const ReferenceResult ref =
      reference_attention_table(q, k, v, pair_mask(mask, m), 1.0 / std::sqrt(double(d)), nullptr);
  const HostTensor o = download(od);
  const auto l = to_host(ld);
  // forward_check.hpp's bound in the compute type, one rounding into OS; P
  // rounded to bf16 before P V on the host matrix engine: u16 max |V| more,
  // twice that for margin (test_half_attention.cpp).
  const double e32 = tolerance<T>(ref, d, kKeys);
  const bool p16 = forward_uses_matrix<T, QS, ExecSpace>(d);
  const double tol_o =
      stored_bound<OS>(e32, max_abs(ref.o)) + (p16 ? 2.0 * roundoff<QS>() * max_abs(v) : 0.0);
  double o_err = 0.0, lse_err = 0.0;
  long wrong_masked = 0, nonfinite = 0, masked = 0;
  for (int a = 0; a < b; ++a)
    for (int x = 0; x < h; ++x)
      for (int i = 0; i < kQueries; ++i) {
        const double want = ref.lse[(std::size_t(a) * h + x) * kQueries + std::size_t(i)];
        const double got = double(l(a, x, i));
        const bool none = std::isinf(want) && want < 0;
        masked += none;
        if (none)
          wrong_masked += !(std::isinf(got) && got < 0);
        else if (std::isfinite(got))
          lse_err = std::max(lse_err, std::abs(got - want));
        else
          ++nonfinite;
        for (int c = 0; c < d; ++c) {
          const double og = o(a, i, x, c);
          if (none)
            wrong_masked += og != 0.0;
          else if (std::isfinite(og))
            o_err = std::max(o_err, std::abs(og - ref.o(a, i, x, c)));
          else
            ++nonfinite;
        }
      }
  const std::string p16_note = p16 ? ", P in bf16" : "";
  INFO("O error ", o_err, " (bound ", tol_o, "), LSE error ", lse_err, " (bound ", e32,
       "), masked rows ", masked, p16_note);
  CHECK(nonfinite == 0);
  CHECK(wrong_masked == 0);
  CHECK(o_err <= tol_o);
  CHECK(lse_err <= e32);
  // Query position 0 sees no key (no key at 0; no document holds it).
  if (std::is_same<Mask, CausalMask>::value || std::is_same<Mask, DocumentMask>::value)
    CHECK(masked > 0);
}

/// The backward block product (T, GQ, GK): dQ stored as GQ, dK and dV as GK;
/// Q, K, V, dO and O stored as the 16-bit type when either is one.
template <class T, class GQ, class GK, class Mask, class Maps>
void check_backward(const Mask& mask, const Maps& m, std::uint64_t seed) {
  using S = std::conditional_t<is_16bit_v<GQ>, GQ, std::conditional_t<is_16bit_v<GK>, GK, T>>;
  const int b = m.b, h = m.h, hkv = m.hkv, d = m.d;
  const std::string what = std::string("backward ") + Maps::name + " T=" + type_name<T>() +
                           " q/k/v/dO/O=" + type_name<S>() + " dQ=" + type_name<GQ>() +
                           " dK/dV=" + type_name<GK>() + " D=" + std::to_string(d);
  INFO(what);
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(b, kQueries, h, d, rng), k = random_tensor(b, kKeys, hkv, d, rng),
             v = random_tensor(b, kKeys, hkv, d, rng), dout = random_tensor(b, kQueries, h, d, rng);
  V4<S> qd("q", b, kQueries, h, d), kd("k", b, kKeys, hkv, d), vd("v", b, kKeys, hkv, d),
      dod("do", b, kQueries, h, d), od("o", b, kQueries, h, d);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  const ReferenceMask pairs = pair_mask(mask, m);
  const double dscale = 1.0 / std::sqrt(double(d));
  // O and LSE of the forward, exact, O stored as S as a forward returns it.
  const ReferenceResult fwd = reference_attention_table(q, k, v, pairs, dscale, nullptr);
  HostTensor o = fwd.o;
  upload(o, od);
  L3<T> ld("lse", b, h, kQueries);
  {
    auto lh = Kokkos::create_mirror_view(ld);
    for (int a = 0; a < b; ++a)
      for (int x = 0; x < h; ++x)
        for (int i = 0; i < kQueries; ++i)
          lh(a, x, i) = T(fwd.lse[(std::size_t(a) * h + x) * kQueries + std::size_t(i)]);
    Kokkos::deep_copy(ld, lh);
  }
  V4<GQ> dq("dq", b, kQueries, h, d);
  V4<GK> dk("dk", b, kKeys, hkv, d), dv("dv", b, kKeys, hkv, d);
  const BlockExtents e{b, h, hkv, kQueries, kKeys, d};
  const BlockLayout layout = backward_layout<T, ExecSpace>(d);
  BackwardBlockOptions blk;
  blk.operands_bf16 = std::is_same<S, bf16>::value;  // as the step loops set it
  const bool matrix = backward_uses_matrix<T, ExecSpace, Mask>(d, blk);
  const auto keys = allocate_backward_keys<T, ExecSpace>(layout, b, hkv, kKeys);
  pack_backward_keys(ExecSpace{}, kd, vd, keys);
  const auto rows = allocate_backward_queries<T, ExecSpace>(layout, b, h, kQueries);
  pack_backward_queries(ExecSpace{}, qd, dod, od, ld, rows, matrix);
  backward_block(ExecSpace{}, e, rows, keys, dq, dk, dv, mask, m.q, m.k, T(dscale), blk);
  Kokkos::fence();

  const ReferenceGrads want = reference_backward_table(q, k, v, dout, pairs, dscale, &o, nullptr);
  const HostTensor got[3] = {download(dq), download(dk), download(dv)};
  const HostTensor* ref[3] = {&want.dq, &want.dk, &want.dv};
  double gmax = 1e-300;
  for (const HostTensor* t : ref) gmax = std::max(gmax, max_abs(*t));
  // test_backward.cpp's bound relative to the largest gradient entry, one
  // rounding into the stored type; bf16 on the host matrix engine rounds P
  // and dS to bf16 before the products: u16 max |g| more, twice for margin.
  const double e_g = (std::is_same<T, double>::value ? 1e-11 : 1e-4) * gmax +
                     (matrix ? 2.0 * roundoff<S>() * gmax : 0.0);
  const double tol[3] = {stored_bound<GQ>(e_g, gmax), stored_bound<GK>(e_g, gmax),
                         stored_bound<GK>(e_g, gmax)};
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int w = 0; w < 3; ++w) {
    double err = 0.0;
    long nonfinite = 0;
    for (std::size_t i = 0; i < got[w].data.size(); ++i) {
      if (!std::isfinite(got[w].data[i]))
        ++nonfinite;
      else
        err = std::max(err, std::abs(got[w].data[i] - ref[w]->data[i]));
    }
    const std::string name = names[w], engine = matrix ? ", on the matrix engine" : "";
    INFO(name, " error ", err, " (bound ", tol[w], ", largest gradient ", gmax, engine, ")");
    CHECK(nonfinite == 0);
    CHECK(err <= tol[w]);
  }
}

/// Every value type of kernel/instantiate.hpp, both directions, one mask and map.
template <class Mask, class Maps>
void check_all_types(const Mask& mask, const Maps& m, std::uint64_t seed) {
  check_forward<double, double, double>(mask, m, seed + 1);
  check_forward<float, float, float>(mask, m, seed + 2);
  check_forward<float, bf16, bf16>(mask, m, seed + 3);
  check_forward<float, bf16, float>(mask, m, seed + 4);
  check_forward<float, fp16, fp16>(mask, m, seed + 5);
  check_forward<float, fp16, float>(mask, m, seed + 6);
  check_backward<double, double, double>(mask, m, seed + 7);
  check_backward<float, float, float>(mask, m, seed + 8);
  check_backward<float, bf16, bf16>(mask, m, seed + 9);
  check_backward<float, bf16, float>(mask, m, seed + 10);
  check_backward<float, fp16, fp16>(mask, m, seed + 11);
  check_backward<float, fp16, float>(mask, m, seed + 12);
}

template <class Mask>
void check_mask(const Mask& mask, std::uint64_t seed) {
  check_all_types(mask, AffineMaps{}, seed);
  check_all_types(mask, TableMaps{}, seed + 100);
}

}  // namespace

TEST_CASE("block products: FullMask") {
  check_mask(FullMask{}, 1000);
}

TEST_CASE("block products: CausalMask") {
  check_mask(CausalMask{}, 2000);
}

TEST_CASE("block products: SlidingWindowMask") {
  check_mask(SlidingWindowMask{24, 3}, 3000);  // keys q - 24 .. q + 3
}

TEST_CASE("block products: PrefixLMMask") {
  check_mask(PrefixLMMask{12}, 4000);
}

TEST_CASE("block products: DocumentMask") {
  // Positions 0..2 and 170.. in no document: those queries see nothing.
  const Documents<MemSpace> docs(std::vector<index_type>{3, 30, 31, 90, 128, 170});
  check_mask(docs.mask(), 5000);
}
