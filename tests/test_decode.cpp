// SPDX-License-Identifier: Apache-2.0
// Serving on one device: attention_decode (split-KV: the keys of a sequence
// cut over teams and merged) and merge_attention, against the fp64
// reference: cache lengths 1 .. 100 000, batches of mixed lengths, empty
// caches (O = 0, LSE = -inf), GQA, masks on global positions through a
// slot -> position map (a rank's shard of a sharded cache), heads-major cache
// storage, forced and automatic splits, NaN and inf rules, argument errors.
// Also built into the per-ISA binaries (tests/CMakeLists.txt): the host
// decode's vector tile products (host/decode_simd.hpp) for each ISA, with the
// types they read in place or widen (fp32, bf16, fp16).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/kernel/decode.hpp>

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

// The per-ISA binaries (BLOCKATTN_TEST_FP32_ONLY) build a subset: the
// reference cases under one mask with empty, partial and full tiles, and the
// NaN / inf rules (each case is one more instantiation per dispatched ISA:
// the whole file cost 2-5 minutes of compile there); fp64 runs the portable
// loops on every ISA: the serial / openmp binaries test it and the rest.
#if defined(BLOCKATTN_TEST_FP32_ONLY) && BLOCKATTN_TEST_FP32_ONLY
#define BLOCKATTN_DECODE_ISA_SUBSET 1
#define BLOCKATTN_DECODE_TYPES float, bf16, fp16
#else
#define BLOCKATTN_DECODE_ISA_SUBSET 0
#define BLOCKATTN_DECODE_TYPES float, double, bf16, fp16
#endif

namespace {

template <class T>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
template <class T>
using V3 = Kokkos::View<compute_t<T>***, Kokkos::LayoutRight, MemSpace>;

/// allowed(q, j) of `mask` with key slot j at global position kpos(j).
template <class Mask, class Pos>
struct SlotMask {
  Mask mask;
  Pos kpos;
  bool allowed(index_type q, index_type j) const { return mask.allowed(q, kpos(j)); }
};

struct DecodeCase {
  std::vector<int> lengths;  // cached keys per sequence
  int rows, heads, kv_heads, dim;
  int splits;                 // 0: automatic
  index_type stride, offset;  // slot j at offset + stride * j
  bool heads_major;           // cache stored (batch, kv_heads, capacity, dim)
};

std::string describe(const DecodeCase& c) {
  std::string s = "lengths={";
  for (int l : c.lengths) s += std::to_string(l) + ",";
  return s + "} rows=" + std::to_string(c.rows) + " H=" + std::to_string(c.heads) +
         " Hkv=" + std::to_string(c.kv_heads) + " D=" + std::to_string(c.dim) +
         " splits=" + std::to_string(c.splits) + " stride=" + std::to_string(c.stride) +
         (c.heads_major ? " heads-major" : " seq-major");
}

template <class T>
double bound(const ReferenceResult& ref, int dim, int keys, bool dot) {
  if constexpr (std::is_same<T, double>::value)
    return tolerance<double>(ref, dim, keys);
  else if constexpr (std::is_same<T, float>::value)
    return tolerance<float>(ref, dim, keys);
  else  // fp32 arithmetic, O rounded once to 16 bits (|O| <= 1: half an ulp <= 2^-8 for bf16,
        // 2^-11 for fp16); on the AVX512-BF16 dot products P is rounded to bf16 before P V
        // (|P - fl(P)| <= 2^-9 P, |v| <= 1: |dO| <= 2^-9)
    return tolerance<float>(ref, dim, keys) + std::ldexp(1.0, -7) + (dot ? std::ldexp(1.0, -9) : 0);
}

/// Whether bf16 decode on this backend runs the AVX512-BF16 dot products
/// (host/decode_bf16.hpp) for `setting` (shapes aside: one row per kv head
/// over a heads-major cache keeps the fp32 vectors).
bool decode_dot_expected(HostMatrix setting) {
  return impl::decode_rounds_p<ExecSpace, bf16>(setting);
}

/// Runs attention_decode on the case under `mask` and checks every sequence
/// against the fp64 reference over its own cached keys; `out` (if given)
/// gets O as doubles.
/// With `sinks` (one logit per query head), a 16-bit O is also checked element
/// by element against one rounding of the fp32 result (rounded_bound): the
/// sink is folded into the normalisation, not applied to the rounded O.
template <class T, class Mask>
void check_decode(const DecodeCase& c, const Mask& mask, std::uint64_t seed,
                  HostMatrix setting = HostMatrix::automatic, std::vector<double>* out = nullptr,
                  const std::vector<double>* sinks = nullptr) {
  INFO(describe(c), " host_matrix ", int(setting), sinks ? " sinks" : "");
  const int B = int(c.lengths.size());
  int cap = 1;
  for (int l : c.lengths) cap = std::max(cap, l);
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(B, c.rows, c.heads, c.dim, rng, 2.0);
  HostTensor k = random_tensor(B, cap, c.kv_heads, c.dim, rng, 2.0);
  HostTensor v = random_tensor(B, cap, c.kv_heads, c.dim, rng);
  V4<T> qd("q", B, c.rows, c.heads, c.dim);
  upload(q, qd);
  // The cache: sequence-major (batch, capacity, kv_heads, dim), or heads-major
  // storage (batch, kv_heads, capacity, dim) seen through a strided View.
  using Strided = Kokkos::View<T****, Kokkos::LayoutStride, MemSpace>;
  V4<T> kst, vst;
  Strided kd, vd;
  if (c.heads_major) {
    kst = V4<T>("k", B, c.kv_heads, cap, c.dim);
    vst = V4<T>("v", B, c.kv_heads, cap, c.dim);
    auto perm = [&](const V4<T>& s) {
      Kokkos::LayoutStride l(B, s.stride(0), cap, s.stride(2), c.kv_heads, s.stride(1), c.dim, 1);
      return Strided(s.data(), l);
    };
    kd = perm(kst);
    vd = perm(vst);
  } else {
    kst = V4<T>("k", B, cap, c.kv_heads, c.dim);
    vst = V4<T>("v", B, cap, c.kv_heads, c.dim);
    kd = Strided(kst);
    vd = Strided(vst);
  }
  upload(k, kd);
  upload(v, vd);
  Kokkos::View<int*, MemSpace> len("lengths", B);
  Kokkos::View<index_type*, MemSpace> qpos("q_positions", B);
  auto lh = Kokkos::create_mirror_view(len);
  auto ph = Kokkos::create_mirror_view(qpos);
  const StridedPositions kpos{c.offset, c.stride};
  for (int b = 0; b < B; ++b) {
    lh(b) = c.lengths[std::size_t(b)];
    // The rows are the newest tokens: just after the last cached key.
    ph(b) = lh(b) > 0 ? kpos(lh(b) - 1) + 1 : index_type(b);
  }
  Kokkos::deep_copy(len, lh);
  Kokkos::deep_copy(qpos, ph);
  V4<T> o("o", B, c.rows, c.heads, c.dim);
  V3<T> lse("lse", B, c.heads, c.rows);
  DecodeOptions opts;
  opts.splits = c.splits;
  opts.host_matrix = setting;
  Kokkos::View<float*, MemSpace> sink_logits("sinks", sinks ? sinks->size() : 0);
  if (sinks) {
    auto sh = Kokkos::create_mirror_view(sink_logits);
    for (std::size_t h = 0; h < sinks->size(); ++h) sh(h) = float((*sinks)[h]);
    Kokkos::deep_copy(sink_logits, sh);
    opts.sinks = sink_logits;
  }
  attention_decode(ExecSpace{}, qd, kd, vd, len, qpos, o, lse, mask, kpos, opts);
  Kokkos::fence();
  auto oh = to_host(o);
  auto lsh = to_host(lse);
  if (out != nullptr) {
    out->clear();
    for (std::size_t e = 0; e < oh.span(); ++e) out->push_back(double(oh.data()[e]));
  }
  const double scale = 1.0 / std::sqrt(double(c.dim));
  for (int b = 0; b < B; ++b) {
    const int n = lh(b);
    HostTensor qb(1, c.rows, c.heads, c.dim), kb(1, n, c.kv_heads, c.dim),
        vb(1, n, c.kv_heads, c.dim);
    for (int i = 0; i < c.rows; ++i)
      for (int h = 0; h < c.heads; ++h)
        for (int d = 0; d < c.dim; ++d) qb(0, i, h, d) = q(b, i, h, d);
    for (int j = 0; j < n; ++j)
      for (int h = 0; h < c.kv_heads; ++h)
        for (int d = 0; d < c.dim; ++d) {
          kb(0, j, h, d) = k(b, j, h, d);
          vb(0, j, h, d) = v(b, j, h, d);
        }
    const ReferenceResult ref = reference_attention(
        qb, kb, vb, SlotMask<Mask, StridedPositions>{mask, kpos}, scale, ph(b), 0, sinks);
    const bool dot = std::is_same<T, bf16>::value && decode_dot_expected(setting);
    const double tol = bound<T>(ref, c.dim, std::max(n, 1), dot);
    // One rounding into 16 bits of an fp32 result within e32 of the reference.
    const double e32 =
        tolerance<float>(ref, c.dim, std::max(n, 1)) + (dot ? std::ldexp(1.0, -9) : 0);
    double o_err = 0, lse_err = 0, rounded = 0;
    bool exact_empty = true, finite = true;
    for (int h = 0; h < c.heads; ++h)
      for (int i = 0; i < c.rows; ++i) {
        const double want = ref.lse[std::size_t(h) * c.rows + i];
        const double got = double(lsh(b, h, i));
        for (int d = 0; d < c.dim; ++d) {
          const double og = double(oh(b, i, h, d));
          if (!std::isfinite(og)) finite = false;
          if (std::isinf(want) && og != 0.0) exact_empty = false;
          const double x = ref.o(0, i, h, d);
          o_err = std::max(o_err, std::abs(og - x));
          if constexpr (std::is_same<T, bf16>::value || std::is_same<T, fp16>::value)
            if (sinks) rounded = std::max(rounded, std::abs(og - x) / rounded_bound<T>(e32, x));
        }
        if (std::isinf(want))
          exact_empty = exact_empty && std::isinf(got) && got < 0;
        else if (std::isfinite(got))
          lse_err = std::max(lse_err, std::abs(got - want));
        else
          finite = false;
      }
    INFO("sequence ", b, " (", n, " keys): O err ", o_err, " LSE err ", lse_err, " bound ", tol,
         "; O err / one rounding's bound ", rounded);
    CHECK(finite);
    CHECK(exact_empty);
    CHECK(o_err <= tol);
    CHECK(lse_err <= tol);
    CHECK(rounded <= 1.0);
  }
}

const DecodeCase decode_case_list[] = {
    {{1}, 1, 4, 4, 64, 0, 1, 0, false},
    {{0, 5, 1000, 333, 0}, 1, 4, 2, 64, 0, 1, 0, false},  // mixed, empty caches
    {{777, 1500}, 4, 8, 2, 128, 0, 1, 0, true},           // GQA, heads-major
    {{2049}, 16, 4, 1, 40, 7, 1, 0, false},               // MQA, 16 rows, odd dim
    {{300, 31, 1}, 3, 2, 2, 16, 64, 3, 2, true},          // a rank's shard: 2 + 3 j
    {{4000}, 2, 6, 3, 96, 1, 1, 0, false},                // one split
};

template <class T>
void decode_cases(std::uint64_t seed) {
  for (const DecodeCase& c : decode_case_list) {
#if !BLOCKATTN_DECODE_ISA_SUBSET
    check_decode<T>(c, FullMask{}, seed++);
    check_decode<T>(c, CausalMask{}, seed++);
#endif
    check_decode<T>(c, causal_window(200), seed++);  // empty, partial and full tiles
  }
}

}  // namespace

TEST_SUITE("decode") {
  TEST_CASE_TEMPLATE("attention_decode matches the fp64 reference", T, BLOCKATTN_DECODE_TYPES) {
    decode_cases<T>(100);
  }

#if !BLOCKATTN_DECODE_ISA_SUBSET
  TEST_CASE(
      "attention_decode: bf16 on AVX512-BF16 dot products (HostMatrix::avx512_bf16) and on fp32 "
      "vectors (off)") {
    // Both settings against the fp64 reference (the dot products round P to
    // bf16: the bound adds 2^-9). Head dims past the cases' 16 .. 128: 33
    // (odd: a pair half outside the row), 80 (64 on the dot products, 16 on
    // the fp32 vectors), 200 (three 64-column blocks, 8 scalar columns);
    // groups of 8 rows and 6 (4 + 2). Where the engine runs vectors the two
    // settings give different bits (the dot path ran); elsewhere both run the
    // fp32 vectors, and the same bits.
    const bool dot = decode_dot_expected(HostMatrix::avx512_bf16);
    std::vector<DecodeCase> cases(std::begin(decode_case_list), std::end(decode_case_list));
    cases.push_back({{1000}, 1, 8, 1, 80, 0, 1, 0, true});
    cases.push_back({{513, 64}, 2, 3, 1, 200, 3, 1, 0, false});
    cases.push_back({{700}, 1, 4, 2, 33, 2, 1, 0, true});
    std::uint64_t seed = 500;
    int differ = 0;
    for (const DecodeCase& c : cases) {
      std::vector<double> fp32_o, dot_o;
      check_decode<bf16>(c, causal_window(200), seed, HostMatrix::off, &fp32_o);
      check_decode<bf16>(c, causal_window(200), seed, HostMatrix::avx512_bf16, &dot_o);
      ++seed;
      if (fp32_o != dot_o) ++differ;
    }
    if (dot) {
      CHECK(differ > 0);
    } else {
      CHECK(differ == 0);
      MESSAGE("SKIPPED: the AVX512-BF16 decode cases (", impl::host_matrix_engine().reason, ")");
    }
  }

  TEST_CASE(
      "attention_decode: bf16 GQA groups on AMX tiles (automatic) and on fp32 vectors (off)") {
    // Both settings against the fp64 reference (the tiles round P to bf16:
    // the bound adds 2^-9). Rows per kv head 2, 3, 5, 8 (2 queries x 4
    // heads), 12, 16 and 20 (a row tile of 16 and one of 4); head dims 32,
    // 64, 96, 128 (Q^T resident in tiles) and 256 (Q^T loaded per step);
    // lengths off multiples of 16, 32 and 128 (the zero-padded blocks);
    // heads-major and sequence-major; one split and several. Where AMX runs
    // the two settings give different bits; elsewhere both run the fp32
    // vectors, and the same bits.
    const bool tiles = impl::decode_may_use_amx<ExecSpace, bf16, bf16>(HostMatrix::automatic);
    const std::vector<DecodeCase> cases = {
        {{1000, 37}, 1, 2, 1, 128, 0, 1, 0, true},    // 2 rows
        {{513}, 1, 6, 2, 32, 3, 1, 0, true},          // 3 rows, D = 32
        {{777, 1500}, 1, 40, 8, 96, 0, 1, 0, true},   // 5 rows, D = 96
        {{2049}, 2, 4, 1, 256, 2, 1, 0, false},       // 8 rows, D = 256
        {{300, 31, 1}, 3, 4, 1, 64, 64, 3, 2, true},  // 12 rows, a rank's shard
        {{4000}, 1, 16, 1, 128, 1, 1, 0, true},       // 16 rows, one split
        {{900, 129}, 5, 4, 1, 64, 0, 1, 0, true},     // 20 rows
    };
    std::uint64_t seed = 700;
    int differ = 0;
    for (const DecodeCase& c : cases) {
      std::vector<double> fp32_o, tile_o;
      check_decode<bf16>(c, causal_window(200), seed, HostMatrix::off, &fp32_o);
      check_decode<bf16>(c, causal_window(200), seed, HostMatrix::automatic, &tile_o);
      check_decode<bf16>(c, FullMask{}, seed + 1000);
      ++seed;
      if (fp32_o != tile_o) ++differ;
    }
    if (tiles) {
      CHECK(differ == int(cases.size()));
    } else {
      MESSAGE("SKIPPED: the AMX decode cases (", impl::host_matrix_engine().reason, ")");
    }
  }

  TEST_CASE("attention_decode: a NaN value on the tiles stays where it is visible") {
    // 8 heads on one kv head, 2 query rows: value 3 of the last key is NaN;
    // the first query row (one position earlier, causal) does not see it.
    const int L = 300, R = 2, H = 8, D = 64;
    V4<bf16> q("q", 1, R, H, D), k("k", 1, L, 1, D), v("v", 1, L, 1, D), o("o", 1, R, H, D);
    V3<float> lse("lse", 1, H, R);
    Kokkos::View<int*, MemSpace> len("len", 1);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", 1);
    Kokkos::deep_copy(q, bf16(0.25f));
    Kokkos::deep_copy(k, bf16(0.5f));
    Kokkos::deep_copy(v, bf16(1.0f));
    Kokkos::deep_copy(len, L);
    Kokkos::deep_copy(qpos, index_type(L - 2));  // the rows at positions L - 2 and L - 1
    auto vh = Kokkos::create_mirror_view(v);
    Kokkos::deep_copy(vh, v);
    vh(0, L - 1, 0, 3) = bf16(std::numeric_limits<float>::quiet_NaN());
    Kokkos::deep_copy(v, vh);
    attention_decode(ExecSpace{}, q, k, v, len, qpos, o, lse, CausalMask{});
    Kokkos::fence();
    auto oh = to_host(o);
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          INFO("row ", i, " head ", h, " column ", d);
          const float x = float(oh(0, i, h, d));
          CHECK(std::isnan(x) == (i == 1 && d == 3));
          if (!std::isnan(x)) CHECK(x == 1.0f);
        }
  }

  TEST_CASE_TEMPLATE(
      "attention_decode with sinks: folded into the normalisation, a 16-bit O rounded once", T,
      float, bf16, fp16) {
    // Sinks below, near and above the rows' LSEs (O scaled by 1 .. ~0.02),
    // and -inf (no sink) on some heads; empty caches (LSE = the sink, O = 0),
    // one split and several (the merge folds the sink).
    std::uint64_t seed = 600;
    for (const DecodeCase& c : decode_case_list) {
      std::vector<double> sinks;
      for (int h = 0; h < c.heads; ++h)
        sinks.push_back(h % 4 == 3 ? -std::numeric_limits<double>::infinity()
                                   : std::vector<double>{2.0, -1.0, 7.5, 4.25}[std::size_t(h % 4)] +
                                         0.5 * (h / 4));
      check_decode<T>(c, causal_window(200), seed++, HostMatrix::automatic, nullptr, &sinks);
    }
  }

  TEST_CASE("attention_decode: 100 000 cached keys, one query, fp32") {
    check_decode<float>({{100000}, 1, 2, 1, 32, 0, 1, 0, false}, CausalMask{}, 7);
    check_decode<float>({{100000, 99999}, 1, 1, 1, 16, 0, 1, 0, true}, FullMask{}, 8);
  }

  TEST_CASE("attention_decode: document masks on a striped shard") {
    // Documents [0, 300), [300, 1000), [1000, 5000): keys at 1 + 4 j (rank 1 of 4).
    const Documents<MemSpace> docs(std::vector<index_type>{0, 300, 1000, 5000});
    const DocumentMask mask = docs.mask(true);
    check_decode<float>({{400, 1200}, 2, 4, 2, 64, 0, 4, 1, false}, mask, 21);
    check_decode<bf16>({{400, 1200}, 2, 4, 2, 64, 5, 4, 1, true}, mask, 22);
  }

  TEST_CASE("attention_decode: the split count does not change the result beyond rounding") {
    for (int splits : {1, 2, 7, 64, 0})
      check_decode<double>({{5000, 17}, 2, 4, 2, 32, splits, 1, 0, false}, CausalMask{}, 31);
  }

#endif

  TEST_CASE(
      "attention_decode: NaN in a visible key makes its row NaN, in a visible value its column, "
      "masked ones nothing") {
    const int n = 600, D = 16;
    V4<float> q("q", 1, 1, 1, D), k("k", 1, n, 1, D), v("v", 1, n, 1, D), o("o", 1, 1, 1, D);
    V3<float> lse("lse", 1, 1, 1);
    Kokkos::deep_copy(q, 0.5f);
    Kokkos::deep_copy(v, 1.0f);
    Kokkos::View<int*, MemSpace> len("len", 1);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", 1);
    Kokkos::deep_copy(len, n);
    for (int slot : {100, 599})
      for (bool in_v : {false, true}) {
        Kokkos::deep_copy(k, 0.25f);
        Kokkos::deep_copy(v, 1.0f);
        Kokkos::deep_copy(Kokkos::subview(in_v ? v : k, 0, slot, 0, 3),
                          std::numeric_limits<float>::quiet_NaN());
        // Query at position 300: causal, slot 100 visible, slot 599 masked.
        Kokkos::deep_copy(qpos, index_type(300));
        DecodeOptions opts;
        opts.splits = 4;
        attention_decode(ExecSpace{}, q, k, v, len, qpos, o, lse, CausalMask{}, OffsetPositions{},
                         opts);
        auto oh = to_host(o);
        auto lh = to_host(lse);
        INFO("NaN at slot ", slot, in_v ? " of v" : " of k");
        if (slot <= 300 && in_v) {  // a visible value: its column only
          CHECK(std::isnan(oh(0, 0, 0, 3)));
          CHECK(oh(0, 0, 0, 0) == doctest::Approx(1.0));
          CHECK(std::isfinite(lh(0, 0, 0)));
        } else if (slot <= 300) {  // a visible key: the row
          CHECK(std::isnan(oh(0, 0, 0, 0)));
          CHECK(std::isnan(lh(0, 0, 0)));
        } else {  // masked: nothing
          CHECK(oh(0, 0, 0, 0) == doctest::Approx(1.0));
          CHECK(oh(0, 0, 0, 3) == doctest::Approx(1.0));
          CHECK(std::isfinite(lh(0, 0, 0)));
        }
      }
  }

  TEST_CASE_TEMPLATE(
      "attention_decode: NaN and inf rules hold for every row of a GQA group with several query "
      "rows",
      T, float, bf16) {
    // 4 query heads on 1 kv head, 3 rows at positions 300 .. 302: 12 rows per
    // team. A NaN or inf at slot 301 is masked for the rows at 300 only: rows
    // of one tile that see it and rows that do not (the host's register tiles
    // of 4 rows hold both: a masked row's P = 0 times inf or NaN must not
    // reach it).
    const int n = 600, D = 80, H = 4, rows = 3;
    V4<T> q("q", 1, rows, H, D), k("k", 1, n, 1, D), v("v", 1, n, 1, D), o("o", 1, rows, H, D);
    V3<T> lse("lse", 1, H, rows);
    Kokkos::deep_copy(q, T(0.5f));
    Kokkos::View<int*, MemSpace> len("len", 1);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", 1);
    Kokkos::deep_copy(len, n);
    Kokkos::deep_copy(qpos, index_type(300));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    struct Bad {
      bool in_v;
      float value;
    };
    // Column 10 in the host's 64-column blocks of the value products, 70 in their tail.
    for (int slot : {100, 301, 599})
      for (int col : {10, 70})
        for (const Bad bad : {Bad{false, nan}, Bad{true, nan}, Bad{true, inf}, Bad{true, -inf}}) {
          Kokkos::deep_copy(k, T(0.25f));
          Kokkos::deep_copy(v, T(1.0f));
          Kokkos::deep_copy(Kokkos::subview(bad.in_v ? v : k, 0, slot, 0, col), T(bad.value));
          for (int run = 0; run < 4; ++run) {
            const int splits = run % 2 == 0 ? 1 : 3;
            DecodeOptions opts;
            opts.splits = splits;
            // bf16: the AVX512-BF16 dot products (where they run) and the fp32 vectors.
            opts.host_matrix = run < 2 ? HostMatrix::avx512_bf16 : HostMatrix::off;
            attention_decode(ExecSpace{}, q, k, v, len, qpos, o, lse, CausalMask{},
                             OffsetPositions{}, opts);
            auto oh = to_host(o);
            auto lh = to_host(lse);
            for (int i = 0; i < rows; ++i)
              for (int h = 0; h < H; ++h) {
                INFO(bad.value, " at slot ", slot, " column ", col, bad.in_v ? " of v" : " of k",
                     ", row ", i, " head ", h, ", splits ", splits, ", host_matrix ",
                     int(opts.host_matrix));
                const bool visible = slot <= 300 + i;
                const double x = double(oh(0, i, h, col));
                if (visible && bad.in_v) {  // its column only: NaN, or the inf (P > 0)
                  if (std::isnan(bad.value))
                    CHECK(std::isnan(x));
                  else
                    CHECK(x == double(bad.value));
                  CHECK(double(oh(0, i, h, col - 1)) == doctest::Approx(1.0));
                  CHECK(double(oh(0, i, h, col + 1)) == doctest::Approx(1.0));
                  CHECK(std::isfinite(double(lh(0, h, i))));
                } else if (visible) {  // the row
                  CHECK(std::isnan(double(oh(0, i, h, 0))));
                  CHECK(std::isnan(double(lh(0, h, i))));
                } else {  // masked: nothing
                  CHECK(double(oh(0, i, h, 0)) == doctest::Approx(1.0));
                  CHECK(x == doctest::Approx(1.0));
                  CHECK(std::isfinite(double(lh(0, h, i))));
                }
              }
          }
        }
  }

#if !BLOCKATTN_DECODE_ISA_SUBSET
  TEST_CASE("attention_decode: argument errors name the argument") {
    V4<float> q("q", 2, 1, 2, 8), k("k", 2, 10, 2, 8), v("v", 2, 10, 2, 8), o("o", 2, 1, 2, 8);
    V3<float> lse("lse", 2, 2, 1);
    Kokkos::View<int*, MemSpace> len("len", 2), len3("len3", 3);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", 2);
    Kokkos::deep_copy(len, 11);
    auto message = [](auto&& f) {
      try {
        f();
      } catch (const invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const std::string over = message([&] { attention_decode(q, k, v, len, qpos, o, lse); });
    CHECK(over.find("'lengths' holds 11 keys") != std::string::npos);
    CHECK(over.find("capacity") != std::string::npos);
    const std::string ext = message([&] { attention_decode(q, k, v, len3, qpos, o, lse); });
    CHECK(ext.find("'lengths'") != std::string::npos);
    Kokkos::deep_copy(len, 3);
    DecodeOptions opts;
    opts.splits = 65;
    const std::string sp = message(
        [&] { attention_decode(q, k, v, len, qpos, o, lse, FullMask{}, OffsetPositions{}, opts); });
    CHECK(sp.find("'opts.splits' is 65") != std::string::npos);
    Kokkos::View<int*, MemSpace> per("per", 2), per3("per3", 3);
    Kokkos::deep_copy(per, 0);
    opts.splits = 0;
    opts.sequence_splits = per;
    const std::string ss = message(
        [&] { attention_decode(q, k, v, len, qpos, o, lse, FullMask{}, OffsetPositions{}, opts); });
    CHECK(ss.find("'opts.sequence_splits' holds 0 at 0, expected 1 .. 64") != std::string::npos);
    opts.sequence_splits = per3;
    const std::string s3 = message(
        [&] { attention_decode(q, k, v, len, qpos, o, lse, FullMask{}, OffsetPositions{}, opts); });
    CHECK(s3.find("'opts.sequence_splits'") != std::string::npos);
  }

  TEST_CASE("attention_decode: each sequence's own key ranges give its own call's bits") {
    // Four sequences of different lengths, GQA, 2 rows: one launch with a
    // key range count per sequence against one launch per sequence.
    const int B = 4, R = 2, H = 4, Hkv = 2, D = 32, cap = 3000;
    const int lengths[B] = {3000, 17, 700, 0};
    const int ranges[B] = {7, 1, 64, 3};
    std::mt19937_64 rng(5);
    HostTensor qt = random_tensor(B, R, H, D, rng, 2.0),
               kt = random_tensor(B, cap, Hkv, D, rng, 2.0),
               vt = random_tensor(B, cap, Hkv, D, rng);
    V4<float> q("q", B, R, H, D), k("k", B, cap, Hkv, D), v("v", B, cap, Hkv, D),
        o("o", B, R, H, D);
    V3<float> lse("lse", B, H, R);
    upload(qt, q);
    upload(kt, k);
    upload(vt, v);
    Kokkos::View<int*, MemSpace> len("len", B), per("per", B);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", B);
    auto lh = Kokkos::create_mirror_view(len);
    auto ph = Kokkos::create_mirror_view(per);
    auto qh = Kokkos::create_mirror_view(qpos);
    for (int b = 0; b < B; ++b) {
      lh(b) = lengths[b];
      ph(b) = ranges[b];
      qh(b) = lengths[b] - 1;
    }
    Kokkos::deep_copy(len, lh);
    Kokkos::deep_copy(per, ph);
    Kokkos::deep_copy(qpos, qh);
    DecodeOptions opts;
    opts.sequence_splits = per;
    attention_decode(ExecSpace{}, q, k, v, len, qpos, o, lse, CausalMask{}, OffsetPositions{},
                     opts);
    const auto oh = to_host(o);
    const auto lsh = to_host(lse);
    for (int b = 0; b < B; ++b) {
      const auto one = Kokkos::make_pair(b, b + 1);
      const auto all = Kokkos::ALL;
      V4<float> o1("o1", 1, R, H, D);
      V3<float> l1("l1", 1, H, R);
      DecodeOptions alone;
      alone.splits = ranges[b];
      attention_decode(ExecSpace{}, Kokkos::subview(q, one, all, all, all),
                       Kokkos::subview(k, one, all, all, all),
                       Kokkos::subview(v, one, all, all, all), Kokkos::subview(len, one),
                       Kokkos::subview(qpos, one), o1, l1, CausalMask{}, OffsetPositions{}, alone);
      const auto o1h = to_host(o1);
      const auto l1h = to_host(l1);
      int differ = 0;
      for (int i = 0; i < R; ++i)
        for (int h = 0; h < H; ++h) {
          differ += std::memcmp(&lsh(b, h, i), &l1h(0, h, i), sizeof(float)) != 0 ? 1 : 0;
          for (int d = 0; d < D; ++d)
            differ += std::memcmp(&oh(b, i, h, d), &o1h(0, i, h, d), sizeof(float)) != 0 ? 1 : 0;
        }
      INFO("sequence ", b, " (", lengths[b], " keys, ", ranges[b], " ranges)");
      CHECK(differ == 0);
    }
  }

  TEST_CASE_TEMPLATE("merge_attention: n parts and two parts give the attention over all keys", T,
                     float, double) {
    const int B = 2, N = 5, Nk = 700, H = 4, Hkv = 2, D = 32;
    std::mt19937_64 rng(5);
    HostTensor q = random_tensor(B, N, H, D, rng, 2.0), k = random_tensor(B, Nk, Hkv, D, rng, 2.0),
               v = random_tensor(B, Nk, Hkv, D, rng);
    V4<T> qd("q", B, N, H, D), kd("k", B, Nk, Hkv, D), vd("v", B, Nk, Hkv, D);
    upload(q, qd);
    upload(k, kd);
    upload(v, vd);
    // Queries at 200 .. 204 under a causal mask: the parts [400, 700) see no key.
    const index_type q_offset = 200;
    const int cuts[] = {0, 1, 150, 400, 700};
    const int parts = 4;
    Kokkos::View<T*****, Kokkos::LayoutRight, MemSpace> op("op", parts, B, N, H, D);
    Kokkos::View<T****, Kokkos::LayoutRight, MemSpace> lp("lp", parts, B, H, N);
    for (int s = 0; s < parts; ++s) {
      const auto ks = Kokkos::subview(kd, Kokkos::ALL, Kokkos::make_pair(cuts[s], cuts[s + 1]),
                                      Kokkos::ALL, Kokkos::ALL);
      const auto vs = Kokkos::subview(vd, Kokkos::ALL, Kokkos::make_pair(cuts[s], cuts[s + 1]),
                                      Kokkos::ALL, Kokkos::ALL);
      ForwardOptions fo;
      fo.q_offset = q_offset;
      fo.k_offset = cuts[s];
      attention_forward(ExecSpace{}, qd, ks, vs,
                        Kokkos::subview(op, s, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(lp, s, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL), CausalMask{},
                        fo);
    }
    const ReferenceResult ref =
        reference_attention(q, k, v, CausalMask{}, 1.0 / std::sqrt(double(D)), q_offset, 0);
    const double tol = tolerance<T>(ref, D, Nk);
    V4<T> o("o", B, N, H, D);
    V3<T> lse("lse", B, H, N);
    merge_attention(ExecSpace{}, op, lp, o, lse);
    ErrorReport e = compare(ref, o, lse);
    INFO("n-part merge: O err ", e.o_err, " LSE err ", e.lse_err, " bound ", tol);
    CHECK(e.finite);
    CHECK(e.o_err <= tol);
    CHECK(e.lse_err <= tol);
    // Pairwise, in place, in another order: ((3 + 1) + 0) + 2.
    auto po = [&](int s) {
      return Kokkos::subview(op, s, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
    };
    auto pl = [&](int s) { return Kokkos::subview(lp, s, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL); };
    merge_attention(ExecSpace{}, po(3), pl(3), po(1), pl(1), po(3), pl(3));
    merge_attention(ExecSpace{}, po(3), pl(3), po(0), pl(0), po(3), pl(3));
    merge_attention(ExecSpace{}, po(3), pl(3), po(2), pl(2), o, lse);
    e = compare(ref, o, lse);
    INFO("pairwise merge: O err ", e.o_err, " LSE err ", e.lse_err, " bound ", tol);
    CHECK(e.finite);
    CHECK(e.o_err <= tol);
    CHECK(e.lse_err <= tol);
  }

  TEST_CASE("merge_attention: -inf parts add nothing, all -inf gives O = 0, a NaN part gives NaN") {
    const int D = 4;
    Kokkos::View<float*****, Kokkos::LayoutRight, MemSpace> op("op", 3, 1, 3, 1, D);
    Kokkos::View<float****, Kokkos::LayoutRight, MemSpace> lp("lp", 3, 1, 1, 3);
    auto oh = Kokkos::create_mirror_view(op);
    auto lh = Kokkos::create_mirror_view(lp);
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int s = 0; s < 3; ++s)
      for (int d = 0; d < D; ++d)
        for (int r = 0; r < 3; ++r) oh(s, 0, r, 0, d) = float(s + 1);
    // Row 0: parts (lse 0, -inf, 0) -> mean of parts 0 and 2 = 2. Row 1: all -inf.
    // Row 2: part 1 NaN.
    const float l[3][3] = {{0.f, -inf, 0.f}, {-inf, -inf, -inf}, {1.f, nan, 2.f}};
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 3; ++s) lh(s, 0, 0, r) = l[r][s];
    Kokkos::deep_copy(op, oh);
    Kokkos::deep_copy(lp, lh);
    Kokkos::View<float****, Kokkos::LayoutRight, MemSpace> o("o", 1, 3, 1, D);
    Kokkos::View<float***, Kokkos::LayoutRight, MemSpace> lse("lse", 1, 1, 3);
    merge_attention(ExecSpace{}, op, lp, o, lse);
    auto ot = to_host(o);
    auto lt = to_host(lse);
    CHECK(ot(0, 0, 0, 0) == doctest::Approx(2.0));
    CHECK(lt(0, 0, 0) == doctest::Approx(std::log(2.0)));
    CHECK(ot(0, 1, 0, 0) == 0.0f);
    CHECK((std::isinf(lt(0, 0, 1)) && lt(0, 0, 1) < 0));
    CHECK(std::isnan(ot(0, 2, 0, 0)));
    CHECK(std::isnan(lt(0, 0, 2)));
  }
#endif
}  // TEST_SUITE
