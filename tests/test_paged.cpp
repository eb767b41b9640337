// SPDX-License-Identifier: Apache-2.0
// Paged KV caches: attention_decode_paged on one device against
// attention_decode over the same keys stored contiguously (the same bits:
// pages of 8 to 256 slots in shuffled pool order, forced and automatic
// splits, GQA, fp32 / bf16 / fp16, masks and sinks, one and several rows;
// each result also within the fp64 reference's bound); PagedKVCache over
// ranks (both placements, tree and ring merges, decode and chunked prefill
// on both kernels) against a KVCache holding the same tokens, bit for bit;
// prefix sharing with copy-on-write (a write after fork leaves the other
// sequence's results unchanged); 8-bit paged and contiguous caches over
// ranks (the same bits, within the fp32 bound of the dequantized values);
// errors (a block table entry outside the
// pool, a sequence released twice, an exhausted pool on one rank: every
// rank throws, nothing appended anywhere).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "serve_check.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

using Comm = ServeComm;

/// One device: the same keys contiguous (B, cap, Hkv, D) and in pages of
/// `ps` slots, the pages of all sequences shuffled over the pool; decode of
/// the last `rows` tokens of each sequence by both, compared bit for bit and
/// against fp64.
template <class T, class Mask>
void check_paged_decode(const std::vector<int>& lengths, int rows, int H, int Hkv, int D, int ps,
                        int splits, const Mask& mask, std::uint64_t seed,
                        const std::vector<float>* sinks = nullptr) {
  const int B = int(lengths.size());
  const int cap = std::max(1, *std::max_element(lengths.begin(), lengths.end()));
  const int width = (cap + ps - 1) / ps;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(B, rows, H, D, rng, 2.0);
  HostTensor k = random_tensor(B, cap, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(B, cap, Hkv, D, rng);
  V4<T> qd("q", B, rows, H, D), kd("k", B, cap, Hkv, D), vd("v", B, cap, Hkv, D);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  // The pool: every sequence's pages, one spare page per sequence, shuffled.
  const int pages = B * width + B;
  std::vector<int> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Kokkos::View<T****, Kokkos::LayoutRight, MemSpace> kp("kp", pages, ps, Hkv, D),
      vp("vp", pages, ps, Hkv, D);
  Kokkos::View<int**, MemSpace> table("table", B, width);
  auto kph = Kokkos::create_mirror_view(kp);
  auto vph = Kokkos::create_mirror_view(vp);
  auto th = Kokkos::create_mirror_view(table);
  auto kh = to_host(kd);
  auto vh = to_host(vd);
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < width; ++p) {
      const int page = order[std::size_t(b * width + p)];
      th(b, p) = page;
      for (int s = 0; s < ps && p * ps + s < cap; ++s)
        for (int g = 0; g < Hkv; ++g)
          for (int d = 0; d < D; ++d) {
            kph(page, s, g, d) = kh(b, p * ps + s, g, d);
            vph(page, s, g, d) = vh(b, p * ps + s, g, d);
          }
    }
  Kokkos::deep_copy(kp, kph);
  Kokkos::deep_copy(vp, vph);
  Kokkos::deep_copy(table, th);
  Kokkos::View<int*, MemSpace> len("len", B);
  Kokkos::View<index_type*, MemSpace> qpos("qpos", B);
  auto lh = Kokkos::create_mirror_view(len);
  auto qh = Kokkos::create_mirror_view(qpos);
  for (int b = 0; b < B; ++b) {
    lh(b) = lengths[std::size_t(b)];
    qh(b) = std::max(0, lengths[std::size_t(b)] - rows);
  }
  Kokkos::deep_copy(len, lh);
  Kokkos::deep_copy(qpos, qh);
  DecodeOptions opts;
  opts.splits = splits;
  Kokkos::View<float*, MemSpace> sink_view("sinks", sinks ? sinks->size() : 0);
  if (sinks) {
    auto h = Kokkos::create_mirror_view(sink_view);
    for (std::size_t i = 0; i < sinks->size(); ++i) h(i) = (*sinks)[i];
    Kokkos::deep_copy(sink_view, h);
    opts.sinks = sink_view;
  }
  V4<T> o_c("o", B, rows, H, D), o_p("o", B, rows, H, D);
  V3<T> l_c("lse", B, H, rows), l_p("lse", B, H, rows);
  attention_decode(ExecSpace{}, qd, kd, vd, len, qpos, o_c, l_c, mask, OffsetPositions{}, opts);
  attention_decode_paged(ExecSpace{}, qd, kp, vp, table, len, qpos, o_p, l_p, mask,
                         OffsetPositions{}, opts);
  Kokkos::fence();
  INFO(value_type_name<T>(), " H=", H, " Hkv=", Hkv, " D=", D, " rows=", rows, " page=", ps,
       " splits=", splits, " ", impl::type_name<Mask>());
  CHECK(same_bits(o_c, o_p));
  CHECK(same_bits(l_c, l_p));
  // And the fp64 reference (sequence by sequence; 16-bit O rounded once).
  std::vector<double> sk;
  if (sinks)
    for (float s : *sinks) sk.push_back(s);
  auto oh = to_host(o_p);
  auto lsh = to_host(l_p);
  double worst = 0.0;
  bool ok = true;
  for (int b = 0; b < B; ++b) {
    const int L = lengths[std::size_t(b)];
    HostTensor qb(1, rows, H, D), kb(1, std::max(L, 1), Hkv, D), vb(1, std::max(L, 1), Hkv, D);
    for (int i = 0; i < rows; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) qb(0, i, h, d) = q(b, i, h, d);
    for (int j = 0; j < L; ++j)
      for (int g = 0; g < Hkv; ++g)
        for (int d = 0; d < D; ++d) {
          kb(0, j, g, d) = k(b, j, g, d);
          vb(0, j, g, d) = v(b, j, g, d);
        }
    if (L == 0) continue;
    const ReferenceResult ref =
        reference_attention(qb, kb, vb, mask, 1.0 / std::sqrt(double(D)), std::max(0, L - rows), 0,
                            sinks ? &sk : nullptr);
    // fp32 arithmetic's bound; 16-bit: O rounded once (u |O|, |O| <= max|V|
    // <= 1) and, on the bf16 dot products, P rounded to bf16 before P V
    // (u / 2 max|V|): 4 u covers both.
    double tol = tolerance<float>(ref, D, L);
    if constexpr (!std::is_same<T, float>::value) tol += 4.0 * T::unit_roundoff;
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < rows; ++i) {
        const double want = ref.lse[std::size_t(h) * rows + i];
        const double got = double(lsh(b, h, i));
        if (std::isinf(want)) {
          ok = ok && std::isinf(got);
          continue;
        }
        worst = std::max(worst, std::abs(got - want) / tol);
        for (int d = 0; d < D; ++d)
          worst = std::max(worst, std::abs(double(oh(b, i, h, d)) - ref.o(0, i, h, d)) / tol);
      }
  }
  INFO("worst error / bound ", worst);
  CHECK(ok);
  CHECK(worst <= 1.0);
}

/// K, V rows [t0, t0 + n) of sequence s of a global tensor, as a device View.
template <class T>
V4<T> rows_view(const HostTensor& t, int s, int t0, int n) {
  HostTensor r(1, n, t.h, t.d);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < t.h; ++h)
      for (int d = 0; d < t.d; ++d) r(0, i, h, d) = t(s, t0 + i, h, d);
  V4<T> out("rows", 1, n, t.h, t.d);
  upload(r, out);
  return out;
}

/// Over ranks: a PagedKVCache and a KVCache fed the same chunks; decode with
/// both merges and chunked prefill on both kernels give the same bits.
template <class T, class Placement>
void check_paged_cache(Comm& comm, const Placement& pl, int ps, std::uint64_t seed) {
  const int P = comm.size(), B = 3, H = 4, Hkv = 2, D = 32, rows = 2;
  const std::vector<int> lengths = {rows, 5 * ps + 3, 300};
  const int longest = 400;  // the prefill below grows sequence 2 to 300 + 90
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(B, longest, H, D, rng, 2.0);
  HostTensor k = random_tensor(B, longest, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(B, longest, Hkv, D, rng);
  KVCache<T, ExecSpace, Placement> flat(comm, B, pl.local_capacity(longest, P), Hkv, D, pl);
  PagedKVCache<T, ExecSpace, Placement> paged(comm, B, 64, ps, Hkv, D, pl, longest);
  for (int s = 0; s < B; ++s)
    for (int t0 = 0; t0 < lengths[std::size_t(s)];) {
      const int n = std::min(lengths[std::size_t(s)] - t0, t0 == 0 ? 37 : 1 + t0 % 5);
      const auto kr = rows_view<T>(k, s, t0, n), vr = rows_view<T>(v, s, t0, n);
      flat.append(ExecSpace{}, s, kr, vr);
      append_kv(comm, ExecSpace{}, paged, s, kr, vr);
      t0 += n;
    }
  for (int s = 0; s < B; ++s) {
    CHECK(paged.length(s) == flat.length(s));
    CHECK(paged.local_length(s) == flat.local_length(s));
  }
  V4<T> qd("q", B, rows, H, D);
  {
    HostTensor qr(B, rows, H, D);
    for (int s = 0; s < B; ++s)
      for (int i = 0; i < rows; ++i)
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d)
            qr(s, i, h, d) = q(s, lengths[std::size_t(s)] - rows + i, h, d);
    upload(qr, qd);
  }
  for (MergeAlgorithm merge : {MergeAlgorithm::tree, MergeAlgorithm::ring}) {
    ServeOptions opts;
    opts.merge = merge;
    V4<T> o_f("o", B, rows, H, D), o_p("o", B, rows, H, D);
    V3<T> l_f("lse", B, H, rows), l_p("lse", B, H, rows);
    decode_attention(comm, ExecSpace{}, flat, qd, o_f, l_f, CausalMask{}, opts);
    decode_attention(comm, ExecSpace{}, paged, qd, o_p, l_p, CausalMask{}, opts);
    Kokkos::fence();
    INFO("P=", P, " ", impl::type_name<Placement>(), " page=", ps, " ", value_type_name<T>(),
         " merge=", merge == MergeAlgorithm::tree ? "tree" : "ring");
    CHECK(same_bits(o_f, o_p));
    CHECK(same_bits(l_f, l_p));
  }
  // Chunked prefill of sequence 2: small chunks (decode kernel), a large one
  // (the forward's kernels over the gathered pages).
  int t0 = lengths[2];
  for (int chunk : {3, 64, 23}) {
    ServeOptions opts;
    opts.prefill_forward_rows = chunk >= 64 ? 1 : 1 << 30;
    V4<T> o_f("o", 1, chunk, H, D), o_p("o", 1, chunk, H, D);
    V3<T> l_f("lse", 1, H, chunk), l_p("lse", 1, H, chunk);
    const auto qr = rows_view<T>(q, 2, t0, chunk), kr = rows_view<T>(k, 2, t0, chunk),
               vr = rows_view<T>(v, 2, t0, chunk);
    prefill_attention(comm, ExecSpace{}, flat, 2, qr, kr, vr, o_f, l_f, CausalMask{}, opts);
    prefill_attention(comm, ExecSpace{}, paged, 2, qr, kr, vr, o_p, l_p, CausalMask{}, opts);
    Kokkos::fence();
    INFO("prefill chunk ", chunk, " P=", P, " ", impl::type_name<Placement>(), " page=", ps);
    CHECK(same_bits(o_f, o_p));
    CHECK(same_bits(l_f, l_p));
    t0 += chunk;
  }
  CHECK(paged.length(2) == t0);
}

/// Over ranks, 8-bit storage: a KVCache and a PagedKVCache of codes fed the
/// same chunks give the same bits, and within the fp32 bound of the fp64
/// attention of the dequantized values (the rows quantized here as the
/// caches do: core/quant.hpp), decode with both merges and chunked prefill
/// on both kernels.
template <class S, class Placement>
void check_quant_cache(Comm& comm, const Placement& pl, std::uint64_t seed) {
  const int P = comm.size(), H = 4, Hkv = 2, D = 32, rows = 1, len = 300, total = 400;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(1, total, H, D, rng, 2.0);
  HostTensor k = random_tensor(1, total, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(1, total, Hkv, D, rng);
  // The dequantized values, row by row as store_row computes them.
  auto dequantized = [](const HostTensor& t) {
    HostTensor out = t;
    for (int n = 0; n < t.n; ++n)
      for (int h = 0; h < t.h; ++h) {
        float amax = 0.0f;
        for (int d = 0; d < t.d; ++d) amax = std::max(amax, std::abs(float(t(0, n, h, d))));
        const float sc = impl::quant_scale<S>(amax, false);
        for (int d = 0; d < t.d; ++d)
          out(0, n, h, d) =
              double(impl::dequantize(impl::quantize<S>(float(t(0, n, h, d)) / sc)) * sc);
      }
    return out;
  };
  for (HostTensor* t : {&q, &k, &v})
    for (double& x : t->data) x = double(float(x));
  const HostTensor kq = dequantized(k), vq = dequantized(v);
  KVCache<float, ExecSpace, Placement, S> flat(comm, 1, pl.local_capacity(total, P), Hkv, D, pl);
  PagedKVCache<float, ExecSpace, Placement, S> paged(comm, 1, 64, 16, Hkv, D, pl, total);
  for (int t0 = 0; t0 < len;) {
    const int n = std::min(len - t0, t0 == 0 ? 37 : 1 + t0 % 5);
    const auto kr = rows_view<float>(k, 0, t0, n), vr = rows_view<float>(v, 0, t0, n);
    flat.append(ExecSpace{}, 0, kr, vr);
    append_kv(comm, ExecSpace{}, paged, 0, kr, vr);
    t0 += n;
  }
  auto check = [&](const V4<float>& o, const V3<float>& lse, int q0, int n, const char* what) {
    HostTensor qs(1, n, H, D), ks(1, q0 + n, Hkv, D), vs(1, q0 + n, Hkv, D);
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) qs(0, i, h, d) = q(0, q0 + i, h, d);
    for (int j = 0; j < q0 + n; ++j)
      for (int g = 0; g < Hkv; ++g)
        for (int d = 0; d < D; ++d) {
          ks(0, j, g, d) = kq(0, j, g, d);
          vs(0, j, g, d) = vq(0, j, g, d);
        }
    const ReferenceResult ref =
        reference_attention(qs, ks, vs, CausalMask{}, 1.0 / std::sqrt(double(D)), q0, 0);
    const double tol = tolerance<float>(ref, D, q0 + n);
    const ErrorReport r = compare(ref, o, lse);
    INFO("P=", P, " ", impl::type_name<Placement>(), " ", std::string(quant_type_name<S>()), " ",
         what, ": O err ", r.o_err, " LSE err ", r.lse_err, " bound ", tol);
    CHECK(r.finite);
    CHECK(r.o_err <= tol);
    CHECK(r.lse_err <= tol);
  };
  V4<float> qd = rows_view<float>(q, 0, len - rows, rows);
  for (MergeAlgorithm merge : {MergeAlgorithm::tree, MergeAlgorithm::ring}) {
    ServeOptions opts;
    opts.merge = merge;
    V4<float> o_f("o", 1, rows, H, D), o_p("o", 1, rows, H, D);
    V3<float> l_f("lse", 1, H, rows), l_p("lse", 1, H, rows);
    decode_attention(comm, ExecSpace{}, flat, qd, o_f, l_f, CausalMask{}, opts);
    decode_attention(comm, ExecSpace{}, paged, qd, o_p, l_p, CausalMask{}, opts);
    Kokkos::fence();
    CHECK(same_bits(o_f, o_p));
    CHECK(same_bits(l_f, l_p));
    check(o_p, l_p, len - rows, rows, "decode");
  }
  int t0 = len;
  for (int chunk : {5, 64}) {
    ServeOptions opts;
    opts.prefill_forward_rows = chunk >= 64 ? 1 : 1 << 30;  // the forward's kernels: dequantized
    V4<float> o_f("o", 1, chunk, H, D), o_p("o", 1, chunk, H, D);
    V3<float> l_f("lse", 1, H, chunk), l_p("lse", 1, H, chunk);
    const auto qr = rows_view<float>(q, 0, t0, chunk), kr = rows_view<float>(k, 0, t0, chunk),
               vr = rows_view<float>(v, 0, t0, chunk);
    prefill_attention(comm, ExecSpace{}, flat, 0, qr, kr, vr, o_f, l_f, CausalMask{}, opts);
    prefill_attention(comm, ExecSpace{}, paged, 0, qr, kr, vr, o_p, l_p, CausalMask{}, opts);
    Kokkos::fence();
    CHECK(same_bits(o_f, o_p));
    CHECK(same_bits(l_f, l_p));
    check(o_p, l_p, t0, chunk, chunk >= 64 ? "prefill (forward)" : "prefill (decode kernel)");
    t0 += chunk;
  }
}

}  // namespace

TEST_SUITE("paged") {
  // The one-device cases run in the P = 1 test (each rank would repeat them).
  TEST_CASE_TEMPLATE("paged decode gives the contiguous cache's bits (one device)", T, float, bf16,
                     fp16) {
    if (Comm(MPI_COMM_WORLD).size() > 1) return;
    const std::vector<int> lengths = {1, 17, 0, 300, 1000};
    std::uint64_t seed = 7;
    for (int ps : {8, 16, 64, 256})
      for (int splits : {0, 3}) {
        check_paged_decode<T>(lengths, 1, 8, 2, 64, ps, splits, CausalMask{}, seed++);
        check_paged_decode<T>(lengths, 3, 4, 4, 32, ps, splits, causal_window(100), seed++);
      }
    // Sequence-major pages' heads adjacent: MQA, many heads on one kv head.
    check_paged_decode<T>({2000, 77}, 1, 8, 1, 128, 16, 0, CausalMask{}, 40);
    const std::vector<float> sinks{0.5f, -1.0f, 2.0f, -0.5f};
    check_paged_decode<T>(lengths, 2, 4, 2, 48, 32, 0, with_score(CausalMask{}, SoftCap{1.5}), 41,
                          &sinks);
  }

  TEST_CASE("attention_decode_paged rejects a block table outside the pool") {
    if (Comm(MPI_COMM_WORLD).size() > 1) return;
    V4<float> q("q", 2, 1, 2, 16), o("o", 2, 1, 2, 16);
    V3<float> lse("lse", 2, 2, 1);
    Kokkos::View<float****, Kokkos::LayoutRight, MemSpace> kp("kp", 4, 8, 1, 16),
        vp("vp", 4, 8, 1, 16), bad_ps("kp", 4, 12, 1, 16);
    Kokkos::View<int**, MemSpace> table("table", 2, 3);
    Kokkos::View<int*, MemSpace> len("len", 2);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", 2);
    auto th = Kokkos::create_mirror_view(table);
    auto lh = Kokkos::create_mirror_view(len);
    // Sequence 1's second page is 4 (the pool has 0 .. 3); its third is past
    // its length, never read: -1 there is fine.
    th(0, 0) = 0;
    th(0, 1) = -1;
    th(0, 2) = -1;
    th(1, 0) = 1;
    th(1, 1) = 4;
    th(1, 2) = -1;
    lh(0) = 8;
    lh(1) = 10;
    Kokkos::deep_copy(table, th);
    Kokkos::deep_copy(len, lh);
    auto run = [&] { attention_decode_paged(ExecSpace{}, q, kp, vp, table, len, qpos, o, lse); };
    CHECK_THROWS_WITH_AS(run(),
                         doctest::Contains("argument 'block_table' holds page 4 at (1, 1), "
                                           "expected a page of the pool: 0 .. 3"),
                         invalid_argument);
    th(1, 1) = 3;
    Kokkos::deep_copy(table, th);
    CHECK_NOTHROW(run());
    lh(1) = 25;  // past 3 pages of 8
    Kokkos::deep_copy(len, lh);
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("block_table.extent(1) * page_size = 24"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(
        attention_decode_paged(ExecSpace{}, q, bad_ps, bad_ps, table, len, qpos, o, lse),
        doctest::Contains("argument 'k_pages' has extent(1) (page_size) = 12, expected a power "
                          "of two"),
        invalid_argument);
  }

  TEST_CASE_TEMPLATE("a paged cache over ranks gives the contiguous cache's bits", T, float, bf16) {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    check_paged_cache<T>(comm, RoundRobinPlacement{1}, 16, 1);
    check_paged_cache<T>(comm, RoundRobinPlacement{3}, 8, 2);
    check_paged_cache<T>(comm, ContiguousPlacement{(400 + P - 1) / P}, 64, 3);
  }

  TEST_CASE("prefix sharing: forked sequences copy a shared page on their first write") {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size(), H = 4, Hkv = 2, D = 32, ps = 16, prompt = 100;
    for (int placement = 0; placement < 2; ++placement) {
      std::mt19937_64 rng(11 + placement);
      // Sequence 0: the prompt then its own continuation; 1: the prompt,
      // another continuation; 2: the prompt's first 70 tokens, a third.
      const int total = prompt + 40;
      HostTensor q = random_tensor(3, total, H, D, rng, 2.0);
      HostTensor k = random_tensor(3, total, Hkv, D, rng, 2.0);
      HostTensor v = random_tensor(3, total, Hkv, D, rng);
      const int shared[3] = {prompt, prompt, 70};
      for (int s = 1; s < 3; ++s)
        for (int t = 0; t < shared[s]; ++t)
          for (int g = 0; g < Hkv; ++g)
            for (int d = 0; d < D; ++d) {
              k(s, t, g, d) = k(0, t, g, d);
              v(s, t, g, d) = v(0, t, g, d);
            }
      auto run = [&](auto pl) {
        using Pl = decltype(pl);
        KVCache<float, ExecSpace, Pl> flat(comm, 3, pl.local_capacity(total, P), Hkv, D, pl);
        PagedKVCache<float, ExecSpace, Pl> paged(comm, 3, 40, ps, Hkv, D, pl, total);
        for (int s = 0; s < 3; ++s)
          flat.append(ExecSpace{}, s, rows_view<float>(k, s, 0, shared[s]),
                      rows_view<float>(v, s, 0, shared[s]));
        paged.append(ExecSpace{}, 0, rows_view<float>(k, 0, 0, prompt),
                     rows_view<float>(v, 0, 0, prompt));
        const int used = paged.pages() - paged.free_pages();
        paged.fork(0, 1);
        paged.fork(0, 2, 70);
        CHECK(paged.pages() - paged.free_pages() == used);  // shared, not copied
        if (paged.pages_of(0) > 0) {
          const auto th =
              Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), paged.block_table());
          // Sequences 0 and 1, and 2 where its 70 tokens reach this rank.
          const int want = 2 + (pl.local_count(70, comm.rank(), P) > 0 ? 1 : 0);
          CHECK(paged.references(th(0, 0)) == want);
        }
        // Decode row: each sequence's last token.
        auto decode_all = [&](auto& cache, V4<float>& o, V3<float>& lse) {
          V4<float> qd("q", 3, 1, H, D);
          HostTensor qr(3, 1, H, D);
          for (int s = 0; s < 3; ++s)
            for (int h = 0; h < H; ++h)
              for (int d = 0; d < D; ++d) qr(s, 0, h, d) = q(s, int(cache.length(s)) - 1, h, d);
          upload(qr, qd);
          decode_attention(comm, ExecSpace{}, cache, qd, o, lse);
          Kokkos::fence();
        };
        V4<float> o_f("o", 3, 1, H, D), o_p("o", 3, 1, H, D), o_before("o", 3, 1, H, D);
        V3<float> l_f("l", 3, H, 1), l_p("l", 3, H, 1), l_before("l", 3, H, 1);
        decode_all(paged, o_before, l_before);
        decode_all(flat, o_f, l_f);
        CHECK(same_bits(o_f, o_before));
        CHECK(same_bits(l_f, l_before));
        // Sequence 1 writes into the shared partial page (a copy on write);
        // sequence 0 must keep its results.
        for (int step = 0; step < 20; ++step) {
          const int t = prompt + step;
          const auto kr = rows_view<float>(k, 1, t, 1), vr = rows_view<float>(v, 1, t, 1);
          paged.append(ExecSpace{}, 1, kr, vr);
          flat.append(ExecSpace{}, 1, kr, vr);
        }
        for (int t = 70; t < 90; ++t) {
          const auto kr = rows_view<float>(k, 2, t, 1), vr = rows_view<float>(v, 2, t, 1);
          append_kv(comm, ExecSpace{}, paged, 2, kr, vr);
          flat.append(ExecSpace{}, 2, kr, vr);
        }
        decode_all(paged, o_p, l_p);
        decode_all(flat, o_f, l_f);
        INFO("P=", P, " ", impl::type_name<Pl>());
        CHECK(same_bits(o_f, o_p));
        CHECK(same_bits(l_f, l_p));
        // Sequence 0's rows unchanged by the others' writes.
        auto a = to_host(o_p);
        auto b = to_host(o_before);
        bool seq0 = true;
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d) seq0 = seq0 && a(0, 0, h, d) == b(0, 0, h, d);
        CHECK(seq0);
        // Then sequence 0 writes (its last page shared with 1 no longer).
        for (int t = prompt; t < prompt + 10; ++t) {
          const auto kr = rows_view<float>(k, 0, t, 1), vr = rows_view<float>(v, 0, t, 1);
          paged.append(ExecSpace{}, 0, kr, vr);
          flat.append(ExecSpace{}, 0, kr, vr);
        }
        decode_all(paged, o_p, l_p);
        decode_all(flat, o_f, l_f);
        CHECK(same_bits(o_f, o_p));
        CHECK(same_bits(l_f, l_p));
        // Releases: every page back once no sequence references it.
        paged.release(1);
        paged.release(2);
        paged.fork(0, 1, 50);  // released sequences take new prefixes
        paged.fork(0, 2);
        decode_all(paged, o_p, l_p);
        a = to_host(o_p);
        b = to_host(o_f);
        bool kept = true;
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d) kept = kept && a(0, 0, h, d) == b(0, 0, h, d);
        CHECK(kept);
        paged.release(1);
        CHECK_THROWS_WITH_AS(paged.release(1), doctest::Contains("was released already"),
                             invalid_argument);
        paged.release(0);
        paged.release(2);
        CHECK(paged.free_pages() == paged.pages());
      };
      if (placement == 0)
        run(RoundRobinPlacement{1});
      else
        run(ContiguousPlacement{(total + P - 1) / P});
    }
  }

  TEST_CASE("an exhausted pool on one rank: every rank throws, nothing appended anywhere") {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size(), Hkv = 1, D = 16, ps = 8;
    // Contiguous placement, 40 tokens per rank: rank 0 fills first. Pools of
    // 4 pages (32 slots): a 33-token prompt overflows rank 0's pool only.
    const ContiguousPlacement pl{40};
    PagedKVCache<float, ExecSpace, ContiguousPlacement> cache(comm, 2, 4, ps, Hkv, D, pl, 40 * P);
    V4<float> k("k", 1, 33, Hkv, D), v("v", 1, 33, Hkv, D);
    CHECK_THROWS_WITH_AS(append_kv(comm, ExecSpace{}, cache, 0, k, v),
                         doctest::Contains("the page pool of rank 0 is exhausted"),
                         invalid_argument);
    CHECK(cache.length(0) == 0);
    CHECK(cache.free_pages() == 4);
    // The same through prefill_attention.
    V4<float> q("q", 1, 33, 2, D), o("o", 1, 33, 2, D);
    V3<float> lse("lse", 1, 2, 33);
    CHECK_THROWS_WITH_AS(prefill_attention(comm, ExecSpace{}, cache, 0, q, k, v, o, lse),
                         doctest::Contains("the page pool of rank 0 is exhausted"),
                         invalid_argument);
    CHECK(cache.length(0) == 0);
    CHECK(cache.free_pages() == 4);
    // 32 tokens fit; then sequence 1 finds no page on rank 0.
    const auto k32 =
        Kokkos::subview(k, Kokkos::ALL, Kokkos::make_pair(0, 32), Kokkos::ALL, Kokkos::ALL);
    const auto v32 =
        Kokkos::subview(v, Kokkos::ALL, Kokkos::make_pair(0, 32), Kokkos::ALL, Kokkos::ALL);
    append_kv(comm, ExecSpace{}, cache, 0, k32, v32);
    CHECK(cache.length(0) == 32);
    CHECK(cache.free_pages() == (comm.rank() == 0 ? 0 : 4));
    const auto k1 =
        Kokkos::subview(k, Kokkos::ALL, Kokkos::make_pair(0, 1), Kokkos::ALL, Kokkos::ALL);
    CHECK_THROWS_WITH_AS(append_kv(comm, ExecSpace{}, cache, 1, k1, k1),
                         doctest::Contains("is exhausted"), invalid_argument);
    CHECK(cache.length(1) == 0);
    CHECK_THROWS_WITH_AS(
        (PagedKVCache<float, ExecSpace, ContiguousPlacement>(comm, 2, 4, 24, Hkv, D, pl)),
        doctest::Contains("argument 'page_size' = 24, expected a power of two"), invalid_argument);
  }

  TEST_CASE_TEMPLATE("an 8-bit cache over ranks: paged and contiguous alike, within the bound", S,
                     fp8_e4m3, fp8_e5m2, std::int8_t) {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    check_quant_cache<S>(comm, RoundRobinPlacement{1}, 5);
    check_quant_cache<S>(comm, ContiguousPlacement{(400 + P - 1) / P}, 6);
  }
}
