// SPDX-License-Identifier: Apache-2.0
// Seeded random configurations against the independent fp64 reference
// (reference.hpp): shape (batch, global length N of any value -- 1, P - 1,
// primes, 2P + 1, uniform up to 96 P and large (up to 256 P + 512: several tiles
// per rank), so that ranks hold different numbers of tokens or none --, heads, kv
// heads / GQA, head dim), mask (full, causal, window, prefix-LM, packed documents
// of random lengths (DocumentMask: 1-token documents, one document over every
// rank, long-tailed mixes, tokens outside every document; causal or not, with
// or without a window), random block-sparse; one run-time mask type), partition, schedule, value
// type (fp64, fp32, bf16, fp16), forward and backward through DistributedAttention on this
// communicator's P ranks, plus a single-device forward/backward with random offsets (in fp32 for
// the 16-bit types: the single-device 16-bit path has its own tests, test_half_attention.cpp). fp64
// runs every schedule x partition, and a random TablePartition (any token on any rank) with the
// ring, burst and all-gather schedules. The three types computed in fp32 (fp32, bf16, fp16) share
// the kernels and differ only in storage and conversions, so each draws one built-in partition per
// schedule, rotated over the types (random_partition) so that together they cover every schedule x
// built-in partition once: 13 + 4 + 4 + 4 instantiations of DistributedAttention instead of 4 x 13.
// The sanitizer build (BLOCKATTN_RANDOM_TWO_TYPES) draws fp32 and bf16 only. Every configuration
// goes through this small fixed set of instantiations, so the number of configurations costs run
// time, not compile time. Half the 16-bit configurations ask for the tensor-core backward
// (DistributedOptions::tensor_core_backward). The run reports which implementation computed
// the block pairs (kernels, fused provider, matrix engine); where the tensor-core kernels are
// built in (CUDA with cuDNN; ctest random_flash: the host emulator, BLOCKATTN_CUDA_EMULATION,
// with the emulated fused provider) some pairs must have run on them, unless the run asks for
// BlockAttn's kernels alone (BLOCKATTN_RANDOM_PORTABLE: ctest random, the same binary).
//
//   BLOCKATTN_RANDOM_SEED      first seed (default 20261122 + 100000 P); configuration i
//                              uses seed + i, the same on every rank
//   BLOCKATTN_RANDOM_COUNT     configurations per run (default 120)
//   BLOCKATTN_RANDOM_PORTABLE  1: every block pair on BlockAttn's kernels (portable_only in
//                              the distributed and single-device options), never a fused
//                              provider or the tensor-core kernels; the bounds are the kernels'
// The single-device check of configuration i runs on rank i mod P.
//
// A failure prints the seed and a one-line reproducer.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using blockattn::test::ExecSpace;
using blockattn::test::HostTensor;
using blockattn::test::MemSpace;
using Mpi = MpiCommunicator<>;

namespace {

/// One mask type for every random mask (kind chosen at run time), exact
/// classify for the structured kinds, conservative for the block-sparse one.
struct RandomMask {
  int kind = 0;  // 0 full, 1 causal, 2 window [q - a, q + b], 3 prefix-LM a, 4 documents (doc),
                 // 5 block-sparse causal
  index_type a = 0, b = 0;
  std::uint64_t salt = 0;
  DocumentMask doc;  // kind 4; its offsets are owned by Config::documents

  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    switch (kind) {
      case 0:
        return true;
      case 1:
        return k <= q;
      case 2:
        return k - q >= -a && k - q <= b;
      case 3:
        return k < a || k <= q;
      case 4:
        return doc.allowed(q, k);
      default: {
        if (k > q) return false;
        const index_type qb = q / a, kb = k / a;
        if (qb == kb) return true;
        std::uint64_t h = salt ^ (std::uint64_t(qb) * 0x9E3779B97F4A7C15ull) ^
                          (std::uint64_t(kb) * 0xC2B2AE3D27D4EB4Full);
        h ^= h >> 29;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 32;
        return h % 3 != 0;
      }
    }
  }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q0, index_type q1, index_type k0,
                                           index_type k1) const {
    const index_type ql = q1 - 1, kl = k1 - 1;
    switch (kind) {
      case 0:
        return TileKind::full;
      case 1:
        return k0 > ql ? TileKind::empty : (kl <= q0 ? TileKind::full : TileKind::partial);
      case 2: {
        const index_type lo = k0 - ql, hi = kl - q0;
        if (hi < -a || lo > b) return TileKind::empty;
        if (lo >= -a && hi <= b) return TileKind::full;
        return TileKind::partial;
      }
      case 3:
        if (kl < a || kl <= q0) return TileKind::full;
        if (k0 >= a && k0 > ql) return TileKind::empty;
        return TileKind::partial;
      case 4:
        return doc.classify(q0, q1, k0, k1);
      default:
        return k0 > ql ? TileKind::empty : TileKind::partial;
    }
  }
  std::array<std::int64_t, 4> parameters() const {
    return {{kind, a, b, kind == 4 ? doc.parameters()[4] : std::int64_t(salt)}};
  }
  /// No query sees a later key (what BalancedSchedule needs).
  bool lower() const {
    return kind == 1 || (kind == 2 && b == 0) || (kind == 4 && doc.band_right() <= 0) || kind == 5;
  }
  std::string describe() const {
    const char* names[] = {"full", "causal", "window", "prefix-lm", "documents", "block-sparse"};
    std::ostringstream s;
    if (kind == 4) {
      const index_type* off = doc.host_offsets;
      index_type shortest = off[1] - off[0], longest = shortest;
      for (int d = 1; d < doc.documents; ++d) {
        shortest = std::min(shortest, off[d + 1] - off[d]);
        longest = std::max(longest, off[d + 1] - off[d]);
      }
      s << "documents(" << doc.documents << " in [" << off[0] << ", " << off[doc.documents]
        << "), lengths " << shortest << ".." << longest << (doc.causal ? ", causal" : "")
        << ", left=" << doc.left << ", right=" << doc.right << ")";
    } else {
      s << names[kind] << "(a=" << a << ", b=" << b << ")";
    }
    return s.str();
  }
};

struct Config {
  std::uint64_t seed = 0;
  int partition = 0;                        // 0 contiguous, 1 striped, 2 zigzag, 3 table (fp64)
  int schedule = 0;                         // 0 ring, 1 burst, 2 balanced, 3 all-gather
  int type = 0;                             // 0 fp64, 1 fp32, 2 bf16, 3 fp16
  int b = 1, N = 1, h = 1, hkv = 1, d = 8;  // N: global length, any (ranks may hold none)
  index_type q_offset = 0, k_offset = 0;    // single-device call
  bool tensor_core_backward = false;        // DistributedOptions::tensor_core_backward
  bool portable_only = false;  // BLOCKATTN_RANDOM_PORTABLE (not drawn: the same in every config)
  RandomMask mask;
  std::shared_ptr<const Documents<MemSpace>> documents;  // mask kind 4

  std::string describe(int P) const {
    const char* parts[] = {"contiguous", "striped", "zigzag", "table"};
    const char* scheds[] = {"ring", "burst", "balanced", "all-gather"};
    const char* types[] = {"fp64", "fp32", "bf16", "fp16"};
    std::ostringstream s;
    s << "seed " << seed << ": P=" << P << " " << parts[partition] << " " << scheds[schedule] << " "
      << types[type] << " B=" << b << " N=" << N << " H=" << h << " Hkv=" << hkv << " D=" << d
      << " mask=" << mask.describe() << " offsets=(" << q_offset << ", " << k_offset << ")"
      << (tensor_core_backward ? " tensor_core_backward" : "")
      << (portable_only ? " portable_only" : "");
    return s.str();
  }
};

/// The partition each fp32-computed type (fp32, bf16, fp16) runs with each
/// schedule (ring, burst, balanced, all-gather); -1: any (fp64). Per schedule,
/// the three rows together hold every partition it takes.
constexpr int random_partition[4][4] = {{-1, -1, -1, -1}, {0, 1, 0, 2}, {1, 2, 0, 0}, {2, 0, 0, 1}};

/// Offsets of packed documents over [0, N): 1-token documents, one document
/// over every token, long-tailed lengths (Pareto 1.1, as plan's document
/// mixes) or uniform lengths; a quarter of the draws leave some first and /
/// or last tokens outside every document (those queries see nothing).
std::vector<index_type> random_documents(std::mt19937_64& rng, index_type N) {
  auto pick = [&](index_type lo, index_type hi) {
    return std::uniform_int_distribution<index_type>(lo, hi)(rng);
  };
  const index_type begin = pick(0, 3) == 0 ? pick(0, (N - 1) / 4) : 0;
  const index_type end = pick(0, 3) == 0 ? N - pick(0, (N - begin - 1) / 4) : N;
  std::vector<index_type> off{begin};
  const int style = int(pick(0, 3));
  while (off.back() < end) {
    index_type len = 1;
    if (style == 1) len = end - begin;
    if (style == 2) {
      const double u = std::uniform_real_distribution<double>(1e-9, 1.0)(rng);
      len = index_type(std::min(double(N), std::floor(std::pow(u, -1.0 / 1.1))));
    }
    if (style == 3) len = pick(1, std::max<index_type>(1, N / 3));
    off.push_back(std::min(end, off.back() + len));
  }
  return off;
}

Config draw(std::uint64_t seed, int P) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Config c;
  c.seed = seed;
  c.type = pick(0, 3);
#ifdef BLOCKATTN_RANDOM_TWO_TYPES
  c.type = c.type % 2 == 0 ? 2 : 1;  // the sanitizer build: fp32 and bf16 only
#endif
  c.b = pick(1, 2);
  const int heads[] = {1, 2, 3, 4};
  c.h = heads[pick(0, 3)];
  do c.hkv = pick(1, c.h);
  while (c.h % c.hkv != 0);
  const int dims[] = {1, 8, 24, 40, 64, 72, 128, 136};
  c.d = dims[pick(0, 7)];
  // Any length: 3 of 8 draws uniform in 1 .. 96 P, 1 of 8 large (96 P .. 256
  // P + 512: several tiles per rank; small heads to keep the reference quick), the rest the edge
  // cases (1 token, P - 1 tokens: a rank without any, a prime, 2P + 1).
  const int primes[] = {2,  3,  5,  7,  11, 13, 17, 19, 23,  29,  31,  37,  41,  43,  47,  53, 59,
                        61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137};
  switch (pick(0, 7)) {
    case 0:
      c.N = 1;
      break;
    case 1:
      c.N = P > 1 ? P - 1 : 1;
      break;
    case 2:
      c.N = primes[pick(0, 32)];
      break;
    case 3:
      c.N = 2 * P + 1;
      break;
    case 4:
      c.N = pick(96 * P + 1, 256 * P + 512);
      c.b = 1;
      c.h = c.hkv = pick(1, 2);
      c.d = dims[pick(0, 3)];
      break;
    default:
      c.N = pick(1, 96 * P);
  }
  c.schedule = pick(0, 3);
  c.partition = c.schedule == 2 ? 0 : pick(0, 3);
  if (random_partition[c.type][c.schedule] >= 0) c.partition = random_partition[c.type][c.schedule];
  const index_type N = c.N;
  for (;;) {
    c.mask.kind = pick(0, 5);
    c.mask.a = 1 + pick(0, int(N));
    c.mask.b = pick(0, 2) == 0 ? 0 : pick(0, int(N));
    c.mask.salt = rng();
    if (c.mask.kind == 5) c.mask.a = 1 + pick(0, 40);  // block size
    if (c.mask.kind == 4) {
      c.documents = std::make_shared<const Documents<MemSpace>>(random_documents(rng, N));
      const index_type unbounded = std::numeric_limits<index_type>::max();
      const bool causal = pick(0, 2) != 0;
      // Windows: any width, or narrower than two tiles (full tiles at the
      // band's edges).
      auto width = [&] { return pick(0, 2) == 0 ? pick(0, int(N)) : pick(0, 256); };
      const index_type left = pick(0, 1) == 0 ? unbounded : width();
      const index_type right = causal || pick(0, 1) == 0 ? unbounded : width();
      c.mask.doc = c.documents->mask(causal, left, right);
    }
    if (c.schedule != 2 || c.mask.lower()) break;
  }
  c.q_offset = pick(-50, 50);
  c.k_offset = pick(-50, 50);
  // Drawn last (the draws above stay those of earlier seeds): half the 16-bit
  // configurations ask for the tensor-core backward (CUDA with cuDNN and the
  // emulated build take it; elsewhere the option changes nothing).
  c.tensor_core_backward = c.type >= 2 && pick(0, 1) == 1;
  return c;
}

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

template <class T>
V4<T> upload(const HostTensor& t) {
  V4<T> v("x", t.b, t.n, t.h, t.d);
  auto h = Kokkos::create_mirror_view(v);
  for (int a = 0; a < t.b; ++a)
    for (int n = 0; n < t.n; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) h(a, n, x, d) = T(t(a, n, x, d));
  Kokkos::deep_copy(v, h);
  return v;
}

/// Inputs rounded to the value type, so that the reference sees exactly the
/// kernel's inputs.
HostTensor rounded(HostTensor t, int type) {
  for (auto& x : t.data) {
    if (type == 1) x = double(float(x));
    if (type == 2) x = double(bf16(float(x)));
    if (type == 3) x = double(fp16(float(x)));
  }
  return t;
}

struct Errors {
  double o = 0, lse = 0, grad = 0;
  bool pattern_ok = true;  // non-finite exactly where the reference has them (LSE = -inf)
  BlockPathCounts forward, backward;  // distributed: which implementation computed the pairs
};

/// Compares rows [rows] of `got` (this rank's local rows at global positions
/// map(i)) with the reference.
template <class View, class Map>
void compare4(const View& got, const HostTensor& want, const Map& map, double& err, bool& ok) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
  for (int b = 0; b < want.b; ++b)
    for (int i = 0; i < int(got.extent(1)); ++i)
      for (int x = 0; x < want.h; ++x)
        for (int d = 0; d < want.d; ++d) {
          const double g = double(h(b, i, x, d)), w = want(b, int(map(i)), x, d);
          if (!std::isfinite(g)) {
            ok = false;
            continue;
          }
          err = std::max(err, std::abs(g - w));
        }
}

template <class T, class Schedule, class Partition>
Errors run_distributed(Mpi& comm, const Partition& part, const Config& c, const HostTensor& q,
                       const HostTensor& k, const HostTensor& v, const HostTensor& dout,
                       const test::ReferenceResult& ref, const test::ReferenceGrads& grads) {
  const int P = comm.size(), rank = comm.rank();
  const index_type N = c.N;
  const int n = int(local_length(part, N, P, rank));  // may be 0
  V4<T> gq = upload<T>(q), gk = upload<T>(k), gv = upload<T>(v), gdo = upload<T>(dout);
  V4<T> ql("q", c.b, n, c.h, c.d), kl("k", c.b, n, c.hkv, c.d), vl("v", c.b, n, c.hkv, c.d),
      dol("do", c.b, n, c.h, c.d), ol("o", c.b, n, c.h, c.d), dq("dq", c.b, n, c.h, c.d),
      dk("dk", c.b, n, c.hkv, c.d), dv("dv", c.b, n, c.hkv, c.d);
  V3<compute_t<T>> ll("lse", c.b, c.h, n);
  to_local(part, ExecSpace{}, P, rank, gq, ql);
  to_local(part, ExecSpace{}, P, rank, gk, kl);
  to_local(part, ExecSpace{}, P, rank, gv, vl);
  to_local(part, ExecSpace{}, P, rank, gdo, dol);
  DistributedAttention<Partition, RandomMask, Schedule, Mpi, ExecSpace> attn(comm, part, c.mask);
  DistributedOptions fopts;
  fopts.portable_only = c.portable_only;
  const RunStats fs = attn.forward(ql, kl, vl, ol, ll, fopts);
  DistributedOptions bopts;
  bopts.portable_only = c.portable_only;
  bopts.tensor_core_backward = c.tensor_core_backward;
  const RunStats bs = attn.backward(ql, kl, vl, ol, ll, dol, dq, dk, dv, bopts);
  Kokkos::fence();
  const auto map = part.positions(N, P, rank);
  Errors e;
  e.forward = fs.paths();
  e.backward = bs.paths();
  compare4(ol, ref.o, map, e.o, e.pattern_ok);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ll);
  for (int b = 0; b < c.b; ++b)
    for (int x = 0; x < c.h; ++x)
      for (int i = 0; i < n; ++i) {
        const double g = double(lh(b, x, i));
        const double w = ref.lse[(std::size_t(b) * c.h + x) * N + map(i)];
        if (std::isinf(w) || std::isinf(g)) {
          e.pattern_ok = e.pattern_ok && g == w;
          continue;
        }
        e.lse = std::max(e.lse, std::abs(g - w));
      }
  compare4(dq, grads.dq, map, e.grad, e.pattern_ok);
  compare4(dk, grads.dk, map, e.grad, e.pattern_ok);
  compare4(dv, grads.dv, map, e.grad, e.pattern_ok);
  return e;
}

template <class T>
Errors run_single(const Config& c, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                  const HostTensor& dout, const test::ReferenceResult& ref,
                  const test::ReferenceGrads& grads) {
  V4<T> dq("dq", q.b, q.n, q.h, q.d), dk("dk", k.b, k.n, k.h, k.d), dv("dv", v.b, v.n, v.h, v.d),
      o("o", q.b, q.n, q.h, q.d);
  V3<T> l("lse", q.b, q.h, q.n);
  V4<T> tq = upload<T>(q), tk = upload<T>(k), tv = upload<T>(v), tdo = upload<T>(dout);
  ForwardOptions opts;
  opts.q_offset = c.q_offset;
  opts.k_offset = c.k_offset;
  opts.portable_only = c.portable_only;
  attention_forward(ExecSpace{}, tq, tk, tv, o, l, c.mask, opts);
  attention_backward(ExecSpace{}, tq, tk, tv, o, l, tdo, dq, dk, dv, c.mask, opts);
  Kokkos::fence();
  struct Identity {
    index_type operator()(index_type i) const { return i; }
  };
  Errors e;
  compare4(o, ref.o, Identity{}, e.o, e.pattern_ok);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l);
  for (int b = 0; b < q.b; ++b)
    for (int x = 0; x < q.h; ++x)
      for (int i = 0; i < q.n; ++i) {  // (b, h, n) indexing: V3 may be LayoutLeft (GPUs)
        const double g = double(lh(b, x, i)), w = ref.lse[(std::size_t(b) * q.h + x) * q.n + i];
        if (std::isinf(w) || std::isinf(g)) {
          e.pattern_ok = e.pattern_ok && g == w;
          continue;
        }
        e.lse = std::max(e.lse, std::abs(g - w));
      }
  compare4(dq, grads.dq, Identity{}, e.grad, e.pattern_ok);
  compare4(dk, grads.dk, Identity{}, e.grad, e.pattern_ok);
  compare4(dv, grads.dv, Identity{}, e.grad, e.pattern_ok);
  return e;
}

/// A random layout of the N tokens over P ranks (the same on every rank: from
/// the seed): each token on a random rank, or every token on one rank, or
/// runs of random length on random ranks. Ranks hold any number of tokens.
TablePartition<MemSpace> random_table(const Config& c, int P) {
  std::mt19937_64 rng(c.seed ^ 0x7AB1Eull);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::vector<index_type>> ranks(static_cast<std::size_t>(P));
  const int style = pick(0, 2), only = pick(0, P - 1);
  for (index_type t = 0; t < c.N;) {
    const int r = style == 1 ? only : pick(0, P - 1);
    const index_type run = style == 2 ? pick(1, 24) : 1;
    for (index_type e = std::min<index_type>(c.N, t + run); t < e; ++t)
      ranks[std::size_t(r)].push_back(t);
  }
  return TablePartition<MemSpace>(ranks);
}

/// run_distributed with the partition numbered `Part` (0 contiguous, 1 striped, 2 zigzag).
template <class T, class Schedule, int Part>
Errors run_sampled(Mpi& comm, const Config& c, const HostTensor& q, const HostTensor& k,
                   const HostTensor& v, const HostTensor& dout, const test::ReferenceResult& ref,
                   const test::ReferenceGrads& grads) {
  using Partition =
      std::conditional_t<Part == 0, ContiguousPartition,
                         std::conditional_t<Part == 1, StripedPartition, ZigzagPartition>>;
  return run_distributed<T, Schedule>(comm, Partition{}, c, q, k, v, dout, ref, grads);
}

template <class T>
Errors run_config(Mpi& comm, const Config& c, const HostTensor& q, const HostTensor& k,
                  const HostTensor& v, const HostTensor& dout, const test::ReferenceResult& ref,
                  const test::ReferenceGrads& grads) {
  if (c.schedule == 2)
    return run_distributed<T, BalancedSchedule>(comm, ContiguousPartition{}, c, q, k, v, dout, ref,
                                                grads);
  if constexpr (!std::is_same<T, double>::value) {  // one partition per schedule
    constexpr int t = std::is_same<T, float>::value ? 1 : std::is_same<T, bf16>::value ? 2 : 3;
    if (c.schedule == 0)
      return run_sampled<T, RingSchedule, random_partition[t][0]>(comm, c, q, k, v, dout, ref,
                                                                  grads);
    if (c.schedule == 1)
      return run_sampled<T, BurstSchedule, random_partition[t][1]>(comm, c, q, k, v, dout, ref,
                                                                   grads);
    return run_sampled<T, AllGatherSchedule, random_partition[t][3]>(comm, c, q, k, v, dout, ref,
                                                                     grads);
  } else {  // fp64: every partition, and a random table
    auto with = [&](auto schedule) {
      using S = decltype(schedule);
      switch (c.partition) {
        case 0:
          return run_distributed<T, S>(comm, ContiguousPartition{}, c, q, k, v, dout, ref, grads);
        case 1:
          return run_distributed<T, S>(comm, StripedPartition{}, c, q, k, v, dout, ref, grads);
        case 2:
          return run_distributed<T, S>(comm, ZigzagPartition{}, c, q, k, v, dout, ref, grads);
        default:
          return run_distributed<T, S>(comm, random_table(c, comm.size()), c, q, k, v, dout, ref,
                                       grads);
      }
    };
    if (c.schedule == 3) return with(AllGatherSchedule{});
    return c.schedule == 0 ? with(RingSchedule{}) : with(BurstSchedule{});
  }
}

// The reproducer's binary (tests/CMakeLists.txt names the device backends' own).
#ifndef BLOCKATTN_RANDOM_BINARY
#define BLOCKATTN_RANDOM_BINARY "blockattn_test_random"
#endif

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* s = std::getenv(name);
  return s && *s ? std::strtoull(s, nullptr, 10) : fallback;
}

}  // namespace

TEST_CASE("random configurations against the fp64 reference") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  const std::uint64_t first = env_or("BLOCKATTN_RANDOM_SEED", 20261122 + 100000 * std::uint64_t(P));
  const std::uint64_t count = env_or("BLOCKATTN_RANDOM_COUNT", 120);
  const bool portable = env_or("BLOCKATTN_RANDOM_PORTABLE", 0) != 0;
  std::int64_t failed = 0;
  BlockPathCounts forward_paths, backward_paths;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t seed = first + i;
    const bool single_here = int(i % std::uint64_t(P)) == comm.rank();
    Config c = draw(seed, P);
    c.portable_only = portable;
    const int N = c.N;
    std::mt19937_64 rng(seed ^ 0x5DEECE66Dull);
    const HostTensor q = rounded(test::random_tensor(c.b, N, c.h, c.d, rng), c.type),
                     k = rounded(test::random_tensor(c.b, N, c.hkv, c.d, rng), c.type),
                     v = rounded(test::random_tensor(c.b, N, c.hkv, c.d, rng), c.type),
                     dout = rounded(test::random_tensor(c.b, N, c.h, c.d, rng), c.type);
    const double scale = 1.0 / std::sqrt(double(c.d));
    const auto ref = test::reference_attention(q, k, v, c.mask, scale);
    // 16-bit storage where a fused provider is built in (cuDNN): the distributed backward's
    // own band pieces are rounded to 16 bits each before their fp32 sum, so the bound needs
    // each element's sum of absolute terms (ReferenceGrads::abs_dq, ...).
    // The tensor-core backward rounds P and dS to 16 bits as cuDNN does: the same bound.
    const bool fused_backward =
        c.type >= 2 && !portable &&
        (fused_available_v<ExecSpace, bf16> ||
         (c.tensor_core_backward && tensor_core_backward_available_v<ExecSpace, bf16, RandomMask>));
    const auto grads = test::reference_backward(q, k, v, dout, c.mask, scale, 0, 0, nullptr,
                                                nullptr, fused_backward);
    test::ReferenceResult ref_off;
    test::ReferenceGrads grads_off;
    if (single_here) {
      ref_off = test::reference_attention(q, k, v, c.mask, scale, c.q_offset, c.k_offset);
      grads_off = test::reference_backward(q, k, v, dout, c.mask, scale, c.q_offset, c.k_offset);
    }
    Errors dist, single;
    std::string error;
    try {
      switch (c.type) {
#ifndef BLOCKATTN_RANDOM_TWO_TYPES
        case 0:
          dist = run_config<double>(comm, c, q, k, v, dout, ref, grads);
          break;
        case 3:
          dist = run_config<fp16>(comm, c, q, k, v, dout, ref, grads);
          break;
#endif
        case 1:
          dist = run_config<float>(comm, c, q, k, v, dout, ref, grads);
          break;
        default:
          dist = run_config<bf16>(comm, c, q, k, v, dout, ref, grads);
      }
      if (single_here)
        single = c.type == 0 ? run_single<double>(c, q, k, v, dout, ref_off, grads_off)
                             : run_single<float>(c, q, k, v, dout, ref_off, grads_off);
    } catch (const std::exception& e) {
      error = e.what();
    }
    forward_paths += dist.forward;
    backward_paths += dist.backward;
    double gmax = 1e-300;
    const HostTensor* all[] = {&grads.dq,     &grads.dk,     &grads.dv,
                               &grads_off.dq, &grads_off.dk, &grads_off.dv};
    for (const HostTensor* t : all)
      for (double x : t->data) gmax = std::max(gmax, std::abs(x));
    // Forward: the bound of forward_check.hpp (random-walk rounding of the
    // logits, the row sums and P*V); backward: test_backward.cpp's, relative
    // to the largest gradient entry. 16-bit storage: the fp32 bound e32 plus
    // one rounding of the result, e32 + u16 (max|x| + e32) + half the
    // smallest fp16 subnormal (test_half_attention.cpp); LSE stays fp32.
    const bool fp64 = c.type == 0;
    auto tol = [&](const test::ReferenceResult& r) {
      return fp64 ? test::tolerance<double>(r, c.d, N) : test::tolerance<float>(r, c.d, N);
    };
    const double tol_f = tol(ref), tol_s = single_here ? tol(ref_off) : 0.0;
    const double tol_g = fp64 ? 1e-11 : 1e-4;
    const double u16 = c.type == 2 ? bf16::unit_roundoff : fp16::unit_roundoff;
    const auto round16 = [&](double e32, double largest) {
      return c.type < 2 ? e32 : e32 + u16 * (largest + e32) + 2.9802322387695312e-08;
    };
    double omax = 0.0, vmax = 0.0;
    for (double x : ref.o.data) omax = std::max(omax, std::abs(x));
    for (double x : v.data) vmax = std::max(vmax, std::abs(x));
    // bf16 on the host matrix engine (AMX), and 16-bit storage where a fused
    // provider (cuDNN) is built in, round P to 16 bits before P V: at most
    // u16 max|V| more, twice that for margin (the fused bound of
    // test_half_attention.cpp, docs/numerics.md).
    const bool p16 = (c.type == 2 && forward_uses_matrix<float, bf16, ExecSpace>(c.d)) ||
                     (c.type >= 2 && !portable && fused_available_v<ExecSpace, bf16>);
    // The bf16 backward on the host matrix engine rounds P and dS to bf16
    // before the gradient products: u16 max|g| more, twice that for margin.
    BackwardBlockOptions bf16_operands;
    bf16_operands.operands_bf16 = true;
    const bool g16 = c.type == 2 && backward_uses_matrix<float, ExecSpace>(c.d, bf16_operands);
    // The fused backward (cuDNN's pieces, each rounded to 16 bits before the
    // fp32 sum, P and dS rounded inside, travelled queries' D from a proxy O
    // within one rounding): 4 u16 times the largest sum of an element's
    // absolute terms (test_fused_distributed.cpp, docs/numerics.md).
    double abs_max = 0.0;
    if (fused_backward)
      for (const HostTensor* t : {&grads.abs_dq, &grads.abs_dk, &grads.abs_dv})
        for (double x : t->data) abs_max = std::max(abs_max, x);
    const double tol_o = round16(tol_f, omax) + (p16 ? 2.0 * u16 * vmax : 0.0),
                 tol_dg = round16(tol_g * gmax, gmax) + (g16 ? 2.0 * u16 * gmax : 0.0) +
                          4.0 * u16 * abs_max;
    const bool ok = error.empty() && dist.pattern_ok && single.pattern_ok && dist.o <= tol_o &&
                    dist.lse <= tol_f && single.o <= tol_s && single.lse <= tol_s &&
                    dist.grad <= tol_dg && single.grad <= tol_g * gmax;
    if (!ok) {
      ++failed;
      std::ostringstream s;
      s << "rank " << comm.rank() << ": FAILED " << c.describe(P) << "\n  distributed: o " << dist.o
        << " lse " << dist.lse << " grad " << dist.grad / gmax << " pattern " << dist.pattern_ok
        << "; single device: o " << single.o << " lse " << single.lse << " grad "
        << single.grad / gmax << " pattern " << single.pattern_ok << "; tolerances " << tol_o
        << " / " << tol_f << " / " << tol_s << " / " << tol_dg << (error.empty() ? "" : "; threw: ")
        << error << "\n  reproduce: BLOCKATTN_RANDOM_SEED=" << seed << " BLOCKATTN_RANDOM_COUNT=1"
        << (portable ? " BLOCKATTN_RANDOM_PORTABLE=1" : "") << " mpiexec -n " << P
        << " --oversubscribe build/tests/" << BLOCKATTN_RANDOM_BINARY;
      FAIL_CHECK(s.str());
    }
  }
  // Every rank ran the same configurations; report the total once.
  CHECK(comm.allreduce(failed, ReduceOp::sum) == 0);
  // Which implementation computed the block pairs, over every configuration
  // and rank. Where the tensor-core forward is built in (CUDA with cuDNN, and
  // the emulated build), the 16-bit pairs cuDNN does not take (RandomMask has
  // no band member: cuDNN takes only pieces its classify() calls full) at
  // head dims 64 and 128 must have reached it; the
  // tensor-core backward too, where it is built in and some asked for it.
  // BLOCKATTN_RANDOM_PORTABLE: none on a fused provider.
  auto total = [&](std::int64_t x) { return comm.allreduce(x, ReduceOp::sum); };
  const std::int64_t f_all = total(forward_paths.portable + forward_paths.fused),
                     f_fused = total(forward_paths.fused), f_matrix = total(forward_paths.matrix),
                     b_all = total(backward_paths.portable + backward_paths.fused),
                     b_fused = total(backward_paths.fused), b_matrix = total(backward_paths.matrix);
  if (comm.rank() == 0)
    MESSAGE(count, " random configurations at P = ", P,
            std::string(portable ? ", kernels only" : ""), "; forward block pairs: ", f_all, " (",
            f_fused, " fused, ", f_matrix, " on a matrix engine), backward: ", b_all, " (", b_fused,
            " fused, ", b_matrix, " on a matrix engine)");
  if (portable) {
    CHECK(f_fused == 0);
    CHECK(b_fused == 0);
  } else {
    if (impl::flash_enabled<ExecSpace, bf16, RandomMask>() && fused_available_v<ExecSpace, bf16>)
      CHECK(f_matrix > 0);
    if (tensor_core_backward_available_v<ExecSpace, bf16, RandomMask>) CHECK(b_matrix > 0);
  }
}
