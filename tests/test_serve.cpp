// SPDX-License-Identifier: Apache-2.0
// Serving over ranks: KVCache (placements, append, capacity), decode_attention
// and prefill_attention (on the decode kernel and on the forward's kernels)
// against the fp64 reference of the whole sequence:
// cache lengths not divisible by P and shorter than P (empty shards), both
// placements, causal / window / document masks, fp32 and bf16, GQA, tree and
// ring merges (agreeing within the fp32 bound; the ring's result the same
// bits on every rank), errors on every rank alike.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <cstring>
#include <limits>
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

template <class T>
double bound(const ReferenceResult& ref, int dim, int keys) {
  if constexpr (std::is_same<T, float>::value)
    return tolerance<float>(ref, dim, keys);
  else  // fp32 arithmetic, O rounded once to 16 bits
    return tolerance<float>(ref, dim, keys) + std::ldexp(1.0, -7);
}

/// A device View of rows [r0, r0 + n) of sequence s (values already rounded to T).
template <class T>
V4<T> device_rows(const HostTensor& t, int s, int r0, int n) {
  HostTensor r = rows_of(t, s, r0, n);
  V4<T> v("rows", 1, n, t.h, t.d);
  upload(r, v);
  return v;
}

struct Worst {
  double o = 0, lse = 0, bound = 0;
  bool ok = true;
};

/// o, lse (sequence s's rows, at index `at` of the batch) against the fp64
/// reference of queries at positions [len - n, len) over keys [0, len).
template <class T, class Mask>
void compare_rows(const HostTensor& q, const HostTensor& k, const HostTensor& v, int s, int len,
                  int n, const Mask& mask, const V4<T>& o, const V3<T>& lse, int at, Worst& w,
                  const std::vector<double>* sinks = nullptr, double extra = 0.0) {
  const ReferenceResult ref =
      reference_attention(rows_of(q, s, 0, n), rows_of(k, s, 0, len), rows_of(v, s, 0, len), mask,
                          1.0 / std::sqrt(double(q.d)), len - n, 0, sinks);
  const double tol = bound<T>(ref, q.d, std::max(len, 1)) + extra;
  w.bound = std::max(w.bound, tol);
  auto oh = to_host(o);
  auto lh = to_host(lse);
  for (int h = 0; h < q.h; ++h)
    for (int i = 0; i < n; ++i) {
      const double want = ref.lse[std::size_t(h) * n + i], got = double(lh(at, h, i));
      if (std::isinf(want)) {
        w.ok = w.ok && std::isinf(got) && got < 0;
      } else {
        w.ok = w.ok && std::isfinite(got);
        w.lse = std::max(w.lse, std::abs(got - want) / tol);
      }
      for (int d = 0; d < q.d; ++d) {
        const double og = double(oh(at, i, h, d));
        w.ok = w.ok && std::isfinite(og) && (!std::isinf(want) || og == 0.0);
        w.o = std::max(w.o, std::abs(og - ref.o(0, i, h, d)) / tol);
      }
    }
}

/// A fingerprint of a View's bits, the same on every rank iff the bits are.
template <class View>
bool same_bits_on_every_rank(Comm& comm, const View& x) {
  auto h = to_host(x);
  std::uint64_t f = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(h.data());
  for (std::size_t i = 0; i < h.span() * sizeof(typename View::value_type); ++i) {
    f ^= p[i];
    f *= 1099511628211ull;
  }
  const std::int64_t v = std::int64_t(f >> 1);
  return comm.allreduce(v, ReduceOp::min) == comm.allreduce(v, ReduceOp::max);
}

/// The sink logits (fp32, in the space's memory) of `sinks`; empty for none.
Kokkos::View<float*, MemSpace> sink_view(const std::vector<double>* sinks) {
  Kokkos::View<float*, MemSpace> view("sinks", sinks ? sinks->size() : 0);
  if (sinks) {
    auto h = Kokkos::create_mirror_view(view);
    for (std::size_t i = 0; i < sinks->size(); ++i) h(i) = float((*sinks)[i]);
    Kokkos::deep_copy(view, h);
  }
  return view;
}

/// Decode over the cache with `lengths` tokens per sequence (appended token
/// by token in chunks), queries = the last `rows` tokens, under `mask`,
/// with both merges; checks against fp64, and tree vs ring.
template <class T, class Placement, class Mask>
void check_decode(Comm& comm, const std::vector<int>& lengths, int rows, int H, int Hkv, int D,
                  const Placement& placement, const Mask& mask, std::uint64_t seed,
                  const std::vector<double>* sinks = nullptr) {
  const int B = int(lengths.size()), P = comm.size();
  int longest = 0;
  for (int l : lengths) longest = std::max(longest, l);
  std::mt19937_64 rng(seed);  // the same global problem on every rank
  HostTensor q = random_tensor(B, longest, H, D, rng, 2.0);
  HostTensor k = random_tensor(B, longest, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(B, longest, Hkv, D, rng);
  for (HostTensor* t : {&q, &k, &v})
    for (double& x : t->data) x = double(T(float(x)));  // what the cache holds
  KVCache<T, ExecSpace, Placement> cache(comm, B, placement.local_capacity(longest, P), Hkv, D,
                                         placement);
  // Append in uneven chunks per sequence (a prefill chunk, then tokens).
  for (int s = 0; s < B; ++s)
    for (int t0 = 0; t0 < lengths[std::size_t(s)];) {
      const int n = std::min(lengths[std::size_t(s)] - t0, t0 == 0 ? 37 : 1 + t0 % 5);
      cache.append(ExecSpace{}, s, device_rows<T>(k, s, t0, n), device_rows<T>(v, s, t0, n));
      t0 += n;
    }
  for (int s = 0; s < B; ++s) {
    REQUIRE(cache.length(s) == lengths[std::size_t(s)]);
    CHECK(cache.local_length(s) == placement.local_count(lengths[std::size_t(s)], comm.rank(), P));
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
  V4<T> o_tree("o", B, rows, H, D), o_ring("o", B, rows, H, D);
  V3<T> l_tree("lse", B, H, rows), l_ring("lse", B, H, rows);
  ServeOptions opts;
  const auto sink_logits = sink_view(sinks);
  if (sinks) opts.sinks = sink_logits;
  decode_attention(comm, ExecSpace{}, cache, qd, o_tree, l_tree, mask, opts);
  opts.merge = MergeAlgorithm::ring;
  decode_attention(comm, ExecSpace{}, cache, qd, o_ring, l_ring, mask, opts);
  Kokkos::fence();
  Worst tree, ring;
  for (int s = 0; s < B; ++s) {
    // The reference sees q at the sequence's last rows: rows_of(q, s, 0, n)
    // must be those rows, so shift them to the front.
    HostTensor qs(B, lengths[std::size_t(s)], H, D);
    for (int i = 0; i < rows; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) qs(s, i, h, d) = q(s, lengths[std::size_t(s)] - rows + i, h, d);
    compare_rows<T>(qs, k, v, s, lengths[std::size_t(s)], rows, mask, o_tree, l_tree, s, tree,
                    sinks);
    compare_rows<T>(qs, k, v, s, lengths[std::size_t(s)], rows, mask, o_ring, l_ring, s, ring,
                    sinks);
  }
  INFO("P=", P, " B=", B, " rows=", rows, " H=", H, " Hkv=", Hkv, " D=", D, " ",
       impl::type_name<Placement>(), " ", impl::type_name<Mask>(), " ", value_type_name<T>(),
       ": tree O err/bound ", tree.o, " LSE ", tree.lse, "; ring O ", ring.o, " LSE ", ring.lse);
  CHECK(tree.ok);
  CHECK(ring.ok);
  CHECK(tree.o <= 1.0);
  CHECK(tree.lse <= 1.0);
  CHECK(ring.o <= 1.0);
  CHECK(ring.lse <= 1.0);
  CHECK(same_bits_on_every_rank(comm, o_ring));
  CHECK(same_bits_on_every_rank(comm, l_ring));
}

/// Sequence 1 of a two-sequence cache filled by chunked prefill (`chunks`,
/// 301 tokens in all), each chunk's O and LSE against the fp64 reference;
/// forward_rows picks the kernel (ServeOptions::prefill_forward_rows). bf16
/// on the forward's kernels where the host matrix engine runs them: P rounded
/// to bf16 before P V, 2 u max|V| more (docs/numerics.md).
template <class T, class Placement, class Mask>
void check_prefill(Comm& comm, const Placement& pl, const Mask& mask,
                   const std::vector<int>& chunks, int forward_rows, int H, int Hkv, int D,
                   MergeAlgorithm merge, std::uint64_t seed,
                   const std::vector<double>* sinks = nullptr) {
  const int P = comm.size();
  int total = 0;
  for (int c : chunks) total += c;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(2, total, H, D, rng, 2.0);
  HostTensor k = random_tensor(2, total, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(2, total, Hkv, D, rng);
  for (HostTensor* t : {&q, &k, &v})
    for (double& x : t->data) x = double(T(float(x)));
  KVCache<T, ExecSpace, Placement> cache(comm, 2, pl.local_capacity(total, P), Hkv, D, pl);
  ServeOptions opts;
  opts.prefill_forward_rows = forward_rows;
  opts.merge = merge;
  const auto sink_logits = sink_view(sinks);
  if (sinks) opts.sinks = sink_logits;
  bool engine = false;
  double extra = 0.0;
  if constexpr (std::is_same<T, bf16>::value) {
    // The forward's engine (2 u max|V|) or the decode kernel's dot products
    // (P to bf16: u / 2 max|V|, inside the same allowance).
    engine = forward_uses_matrix<float, bf16, ExecSpace>(D, opts.host_matrix) ||
             impl::decode_rounds_p<ExecSpace, bf16>(opts.host_matrix);
    double vmax = 0.0;
    for (double x : v.data) vmax = std::max(vmax, std::abs(x));
    if (engine) extra = 2.0 * bf16::unit_roundoff * vmax;
  }
  Worst w;
  int t0 = 0;
  for (int chunk : chunks) {
    V4<T> o("o", 1, chunk, H, D);
    V3<T> lse("lse", 1, H, chunk);
    prefill_attention(comm, ExecSpace{}, cache, 1, device_rows<T>(q, 1, t0, chunk),
                      device_rows<T>(k, 1, t0, chunk), device_rows<T>(v, 1, t0, chunk), o, lse,
                      mask, opts);
    t0 += chunk;
    HostTensor qs(2, t0, H, D);
    for (int i = 0; i < chunk; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) qs(1, i, h, d) = q(1, t0 - chunk + i, h, d);
    compare_rows<T>(qs, k, v, 1, t0, chunk, mask, o, lse, 0, w, sinks, extra);
    if (merge == MergeAlgorithm::ring) {
      CHECK(same_bits_on_every_rank(comm, o));
      CHECK(same_bits_on_every_rank(comm, lse));
    }
  }
  CHECK(cache.length(0) == 0);
  CHECK(cache.length(1) == total);
  INFO("P=", P, " ", impl::type_name<Placement>(), " ", impl::type_name<Mask>(), " ",
       value_type_name<T>(), " forward_rows=", forward_rows, " engine=", engine, ": O err/bound ",
       w.o, " LSE ", w.lse);
  CHECK(w.ok);
  CHECK(w.o <= 1.0);
  CHECK(w.lse <= 1.0);
}

}  // namespace

TEST_SUITE("serve") {
  TEST_CASE_TEMPLATE("decode over a sharded cache matches the fp64 reference", T, float, bf16) {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    std::uint64_t seed = 1;
    for (int rows : {1, 4}) {
      // Lengths not divisible by P, shorter than P (empty shards), just the queries.
      const std::vector<int> lengths = {rows, rows + 1, P + rows, 7 * P + 3, 1000};
      check_decode<T>(comm, lengths, rows, 4, 2, 64, RoundRobinPlacement{1}, CausalMask{}, seed++);
      check_decode<T>(comm, lengths, rows, 4, 4, 32, RoundRobinPlacement{3}, causal_window(100),
                      seed++);
      check_decode<T>(comm, lengths, rows, 2, 1, 48, ContiguousPlacement{(1000 + P - 1) / P},
                      CausalMask{}, seed++);
    }
    const Documents<MemSpace> docs(std::vector<index_type>{0, 5, 400, 2000});
    check_decode<T>(comm, {300, 1000}, 2, 4, 2, 64, RoundRobinPlacement{2}, docs.mask(true), 50);
  }

  TEST_CASE(
      "decode with a score policy and sinks over a sharded cache matches the fp64 reference") {
    // gpt-oss serving: a causal window with one sink per head (exact fp32
    // sink values: 0.5 steps), and Gemma 2's softcap; sinks enter once, after
    // the merge over the ranks, with either merge.
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    const std::vector<double> sinks{0.5, -1.0, 2.0, -0.5};
    const std::vector<int> lengths = {3, P + 3, 7 * P + 3, 600};
    check_decode<float>(comm, lengths, 1, 4, 2, 64, RoundRobinPlacement{2}, causal_window(64), 70,
                        &sinks);
    check_decode<float>(comm, lengths, 3, 4, 2, 32, ContiguousPlacement{(600 + P - 1) / P},
                        with_score(CausalMask{}, SoftCap{1.5}), 71, &sinks);
    check_decode<float>(comm, lengths, 1, 4, 4, 32, RoundRobinPlacement{1},
                        with_score(causal_window(100), Alibi::geometric(4)), 72);
  }

  TEST_CASE("chunked prefill on the decode kernel and on the forward's kernels matches fp64") {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size(), big = std::numeric_limits<int>::max();
    const std::vector<int> chunks = {64, 1, 100, 136};
    // The default (chunks of >= 8 rows on the forward's kernels), every chunk
    // on the decode kernel, every chunk (one row too) on the forward's.
    for (int forward_rows : {8, big, 1}) {
      check_prefill<float>(comm, RoundRobinPlacement{1}, CausalMask{}, chunks, forward_rows, 4, 2,
                           32, MergeAlgorithm::tree, 77);
      check_prefill<float>(comm, ContiguousPlacement{(301 + P - 1) / P}, CausalMask{}, chunks,
                           forward_rows, 4, 2, 32, MergeAlgorithm::ring, 78);
    }
    // Keys in blocks of 3 per rank: positions from a table where P > 1; a
    // window; chunks shorter and longer than the shards.
    const std::vector<int> odd = {40, 9, 120, 3, 129};
    check_prefill<float>(comm, RoundRobinPlacement{3}, causal_window(50), odd, 8, 4, 4, 64,
                         MergeAlgorithm::ring, 79);
    check_prefill<float>(comm, RoundRobinPlacement{3}, causal_window(50), odd, big, 4, 4, 64,
                         MergeAlgorithm::tree, 79);
    // Documents crossing chunks, sinks, ranks whose shard is empty at first.
    const Documents<MemSpace> docs(std::vector<index_type>{0, 30, 170, 250});
    const std::vector<double> sinks{0.5, -1.0, 2.0, -0.5};
    for (int forward_rows : {1, big})
      check_prefill<float>(comm, ContiguousPlacement{(301 + P - 1) / P}, docs.mask(true), odd,
                           forward_rows, 4, 2, 48, MergeAlgorithm::tree, 80, &sinks);
    // bf16 on both kernels (the forward's on the host matrix engine where it
    // runs, the decode kernel's on AVX512-BF16 dot products where they run),
    // and the automatic choice (-1: 24 rows there, 12 elsewhere).
    for (int forward_rows : {8, big, -1})
      check_prefill<bf16>(comm, RoundRobinPlacement{1}, CausalMask{}, chunks, forward_rows, 8, 2,
                          64, MergeAlgorithm::tree, 81);
  }

  TEST_CASE("KVCache: append places rows of any source layout in their slots") {
    // Two appends to two sequences from LayoutLeft views (head_dim elements
    // strided in memory, the other dimensions too) and from a LayoutRight
    // subview: every value lands at its (sequence, slot, kv head, d) on the
    // rank the placement names, bit for bit (distinct small integers).
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size(), S = 2, H = 3, D = 20, n0 = 5, n1 = 4;
    const RoundRobinPlacement pl{2};
    KVCache<float, ExecSpace, RoundRobinPlacement> cache(comm, S, pl.local_capacity(n0 + n1, P), H,
                                                         D, pl);
    auto value = [](int s, int t, int g, int d, bool key) {
      return float(key ? 0 : 1 << 20) + float(s * 100000 + t * 1000 + g * 200 + d);
    };
    using Left = Kokkos::View<float****, Kokkos::LayoutLeft, MemSpace>;
    Left kl("kl", S, n0, H, D), vl("vl", S, n0, H, D);
    auto klh = Kokkos::create_mirror_view(kl), vlh = Kokkos::create_mirror_view(vl);
    for (int s = 0; s < S; ++s)
      for (int t = 0; t < n0; ++t)
        for (int g = 0; g < H; ++g)
          for (int d = 0; d < D; ++d) {
            klh(s, t, g, d) = value(s, t, g, d, true);
            vlh(s, t, g, d) = value(s, t, g, d, false);
          }
    Kokkos::deep_copy(kl, klh);
    Kokkos::deep_copy(vl, vlh);
    cache.append(ExecSpace{}, kl, vl);
    // Sequence 1 only: n1 more tokens, rows 1 .. n1 of a LayoutRight view.
    V4<float> kr("kr", 1, n1 + 1, H, D), vr("vr", 1, n1 + 1, H, D);
    auto krh = Kokkos::create_mirror_view(kr), vrh = Kokkos::create_mirror_view(vr);
    for (int t = 0; t < n1; ++t)
      for (int g = 0; g < H; ++g)
        for (int d = 0; d < D; ++d) {
          krh(0, t + 1, g, d) = value(1, n0 + t, g, d, true);
          vrh(0, t + 1, g, d) = value(1, n0 + t, g, d, false);
        }
    Kokkos::deep_copy(kr, krh);
    Kokkos::deep_copy(vr, vrh);
    const auto tail = Kokkos::make_pair(1, n1 + 1);
    cache.append(ExecSpace{}, 1, Kokkos::subview(kr, Kokkos::ALL, tail, Kokkos::ALL, Kokkos::ALL),
                 Kokkos::subview(vr, Kokkos::ALL, tail, Kokkos::ALL, Kokkos::ALL));
    Kokkos::fence();
    CHECK(cache.length(0) == n0);
    CHECK(cache.length(1) == n0 + n1);
    const auto kh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cache.keys());
    const auto vh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cache.values());
    int wrong = 0, seen = 0;
    for (int s = 0; s < S; ++s)
      for (int slot = 0; slot < cache.local_length(s); ++slot) {
        const int t = int(pl.position(slot, comm.rank(), P));
        for (int g = 0; g < H; ++g)
          for (int d = 0; d < D; ++d, ++seen) {
            wrong += kh(s, slot, g, d) != value(s, t, g, d, true);
            wrong += vh(s, slot, g, d) != value(s, t, g, d, false);
          }
      }
    CHECK(wrong == 0);
    CHECK(seen == (cache.local_length(0) + cache.local_length(1)) * H * D);
  }

  TEST_CASE("KVCache: a full shard and a configuration that differs throw on every rank") {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    KVCache<float, ExecSpace> cache(comm, 1, 2, 1, 8);  // 2 slots per rank: 2 P tokens
    V4<float> k("k", 1, 2 * P + 1, 1, 8), v("v", 1, 2 * P + 1, 1, 8);
    std::string msg;
    try {
      cache.append(ExecSpace{}, 0, k, v);
    } catch (const invalid_argument& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("sequence 0 would hold " + std::to_string(2 * P + 1) + " tokens") !=
          std::string::npos);
    CHECK(msg.find("at most 2 slots") != std::string::npos);
    CHECK(cache.length(0) == 0);
    // Fill it exactly; then a decode whose rows differ on the last rank.
    const auto full = Kokkos::make_pair(0, 2 * P);
    cache.append(ExecSpace{}, 0, Kokkos::subview(k, Kokkos::ALL, full, Kokkos::ALL, Kokkos::ALL),
                 Kokkos::subview(v, Kokkos::ALL, full, Kokkos::ALL, Kokkos::ALL));
    CHECK(cache.length(0) == 2 * P);
    CHECK(cache.local_length(0) == 2);
    if (P > 1) {
      const int rows = comm.rank() == P - 1 ? 2 : 1;
      V4<float> q("q", 1, rows, 1, 8), o("o", 1, rows, 1, 8);
      V3<float> lse("lse", 1, 1, rows);
      msg.clear();
      try {
        decode_attention(comm, ExecSpace{}, cache, q, o, lse);
      } catch (const invalid_argument& e) {
        msg = e.what();
      }
      INFO(msg);
      CHECK(msg.find("rows (q.extent(1)) differs between ranks") != std::string::npos);
      // q with the wrong rows on the last rank, o and lse right (as on the
      // other ranks): the error names q's rows, not o.
      V4<float> q1("q", 1, rows, 1, 8), o1("o", 1, 1, 1, 8);
      V3<float> lse1("lse", 1, 1, 1);
      msg.clear();
      try {
        decode_attention(comm, ExecSpace{}, cache, q1, o1, lse1);
      } catch (const invalid_argument& e) {
        msg = e.what();
      }
      INFO(msg);
      CHECK(msg.find("rows (q.extent(1)) differs between ranks: 1 on rank") != std::string::npos);
      CHECK(msg.find("2 on rank " + std::to_string(P - 1)) != std::string::npos);
      CHECK(msg.find("argument 'o'") == std::string::npos);
    }
    // A bad argument on one rank only: every rank throws its message.
    V4<float> q("q", 1, 1, 1, comm.rank() == 0 ? 8 : 8), o("o", 1, 1, 1, 8);
    V3<float> lse_bad("lse", 1, 1, comm.rank() == 0 ? 2 : 1);
    msg.clear();
    try {
      decode_attention(comm, ExecSpace{}, cache, q, o, lse_bad);
    } catch (const invalid_argument& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("argument 'lse' has extent(2) = 2, expected 1") != std::string::npos);
    CHECK(msg.find("[rank 0 of") != std::string::npos);
    // A prefill whose k is wrong on rank 0 only: every rank throws and no
    // rank appends anything.
    KVCache<float, ExecSpace> fresh(comm, 1, 8, 1, 8);
    V4<float> qc("q", 1, 3, 1, 8), oc("o", 1, 3, 1, 8), vc("v", 1, 3, 1, 8);
    V4<float> kc("k", 1, 3, 1, comm.rank() == 0 ? 4 : 8);
    V3<float> lc("lse", 1, 1, 3);
    msg.clear();
    try {
      prefill_attention(comm, ExecSpace{}, fresh, 0, qc, kc, vc, oc, lc);
    } catch (const invalid_argument& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("argument 'k' has extent(3) (head_dim) = 4, expected 8") != std::string::npos);
    CHECK(fresh.length(0) == 0);
    CHECK(fresh.local_length(0) == 0);
    // A prefill_forward_rows below -1 (automatic): every rank throws, nothing appended.
    V4<float> kc8("k", 1, 3, 1, 8);
    ServeOptions bad;
    bad.prefill_forward_rows = -2;
    msg.clear();
    try {
      prefill_attention(comm, ExecSpace{}, fresh, 0, qc, kc8, vc, oc, lc, CausalMask{}, bad);
    } catch (const invalid_argument& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("argument 'opts.prefill_forward_rows' is -2, expected -1 (automatic) or >= 0") !=
          std::string::npos);
    CHECK(fresh.length(0) == 0);
  }
}  // TEST_SUITE
