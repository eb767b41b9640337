// SPDX-License-Identifier: Apache-2.0
// Decode benchmarks (serving): one query row per sequence against a long key
// cache, split-KV on one device, as tokens/s and as GB/s of K/V read, next to
// a plain read of the same bytes measured in the same run (decode is memory
// bound: the read is its ceiling), and with --torch=FILE PyTorch's
// scaled_dot_product_attention on the same shapes (bench/torch_decode.py,
// same threads, just before). --prefill: chunked prefill on one device,
// the decode kernel next to the forward's kernels and next to one
// attention_forward call of the same rows and keys (its ceiling).
#include <blockattn/blockattn.hpp>
#include <blockattn/kernel/decode.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../tools/cli_args.hpp"

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Best-of-reps seconds of f() (fenced).
template <class F>
double best_of(int reps, F&& f) {
  f();  // warm up (first touch, thread start)
  Kokkos::fence();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    Kokkos::fence();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

/// A plain read of every byte of `a` and `b` (64-bit words summed, so
/// nothing is skipped and no conversion limits it).
template <class V>
double read_seconds(const V& a, const V& b, int reps) {
  using S = typename V::non_const_value_type;
  const auto* pa = reinterpret_cast<const std::uint64_t*>(a.data());
  const auto* pb = reinterpret_cast<const std::uint64_t*>(b.data());
  const std::int64_t n = std::int64_t(a.span() * sizeof(S) / 8);
  return best_of(reps, [&] {
    std::uint64_t sum = 0;
    Kokkos::parallel_reduce(
        "bench::read", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, n / 8),
        KOKKOS_LAMBDA(const std::int64_t i, std::uint64_t& s) {
          std::uint64_t acc = 0;
          for (int l = 0; l < 8; ++l) acc += pa[8 * i + l] ^ pb[8 * i + l];
          s += acc;
        },
        sum);
    if (sum == 12345) std::printf(" ");  // keep the sum alive
  });
}

/// PyTorch's decode times from bench/torch_decode.py: "<dtype> <heads|seq> B keys H Hkv D ms"
/// per line, keyed by everything but the time.
std::map<std::string, double> read_torch(const std::string& path) {
  std::map<std::string, double> out;
  std::ifstream in(path);
  std::string dtype, cache;
  int b = 0, n = 0, h = 0, hkv = 0, d = 0;
  double ms = 0;
  while (in >> dtype >> cache >> b >> n >> h >> hkv >> d >> ms) {
    std::ostringstream key;
    key << dtype << ' ' << cache << ' ' << b << ' ' << n << ' ' << h << ' ' << hkv << ' ' << d;
    out[key.str()] = ms;
  }
  return out;
}

template <class T>
void decode_rows(int batch, int keys, int heads, int kv_heads, int dim, int reps, bool heads_major,
                 const std::map<std::string, double>& torch) {
  using CT = blockattn::compute_t<T>;
  Kokkos::View<T****, Kokkos::LayoutRight, Mem> q("q", batch, 1, heads, dim),
      o("o", batch, 1, heads, dim);
  // The cache: heads-major storage (batch, kv_heads, keys, dim), as KVCache
  // keeps it, seen as (batch, keys, kv_heads, dim); or sequence-major.
  using Strided = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
  Kokkos::View<T****, Kokkos::LayoutRight, Mem> ks, vs;
  Strided k, v;
  if (heads_major) {
    ks = decltype(ks)("k", batch, kv_heads, keys, dim);
    vs = decltype(vs)("v", batch, kv_heads, keys, dim);
    const Kokkos::LayoutStride l(batch, ks.stride(0), keys, ks.stride(2), kv_heads, ks.stride(1),
                                 dim, 1);
    k = Strided(ks.data(), l);
    v = Strided(vs.data(), l);
  } else {
    ks = decltype(ks)("k", batch, keys, kv_heads, dim);
    vs = decltype(vs)("v", batch, keys, kv_heads, dim);
    k = ks;
    v = vs;
  }
  Kokkos::View<CT***, Kokkos::LayoutRight, Mem> lse("lse", batch, heads, 1);
  Kokkos::View<int*, Mem> len("len", batch);
  Kokkos::View<blockattn::index_type*, Mem> qpos("qpos", batch);
  Kokkos::deep_copy(q, T(0.01f));
  Kokkos::deep_copy(ks, T(0.02f));
  Kokkos::deep_copy(vs, T(0.5f));
  Kokkos::deep_copy(len, keys);
  Kokkos::deep_copy(qpos, blockattn::index_type(keys));
  blockattn::DecodeOptions opts;
  opts.max_length = keys;
  const double t_dec = best_of(reps, [&] {
    blockattn::attention_decode(Exec{}, q, k, v, len, qpos, o, lse, blockattn::CausalMask{},
                                blockattn::OffsetPositions{}, opts);
  });
  const double t_read = read_seconds(ks, vs, reps);
  const double bytes = 2.0 * double(ks.span()) * sizeof(T);
  std::ostringstream key;
  key << blockattn::value_type_name<T>() << ' ' << (heads_major ? "heads" : "seq") << ' ' << batch
      << ' ' << keys << ' ' << heads << ' ' << kv_heads << ' ' << dim;
  const auto it = torch.find(key.str());
  std::printf("%-5s %-5s %5d %7d %3d %3d %4d %10.3f %10.1f %9.2f %9.2f %6.2f",
              blockattn::value_type_name<T>(), heads_major ? "heads" : "seq", batch, keys, heads,
              kv_heads, dim, t_dec * 1e3, batch / t_dec, bytes / t_dec * 1e-9,
              bytes / t_read * 1e-9, t_read / t_dec);
  if (it != torch.end())
    std::printf(" %10.3f %7.2f\n", it->second, it->second / (t_dec * 1e3));
  else
    std::printf(" %10s %7s\n", "-", "-");
}

/// An 8-bit cache (attention_decode_quantized, heads-major, one fp32 scale
/// per row) against the bf16 cache of the same shape, alternated, best of
/// reps each: tokens/s of each and their ratio; GB/s of the 8-bit cache's
/// bytes (codes and scales) and a plain read of them.
template <class S>
void quant_rows(int batch, int keys, int heads, int kv_heads, int dim, int reps) {
  using blockattn::bf16;
  using Strided16 = Kokkos::View<bf16****, Kokkos::LayoutStride, Mem>;
  using StridedQ = Kokkos::View<S****, Kokkos::LayoutStride, Mem>;
  using StridedS = Kokkos::View<float***, Kokkos::LayoutStride, Mem>;
  Kokkos::View<bf16****, Kokkos::LayoutRight, Mem> q("q", batch, 1, heads, dim),
      o("o", batch, 1, heads, dim);
  Kokkos::View<bf16****, Kokkos::LayoutRight, Mem> kb("k", batch, kv_heads, keys, dim),
      vb("v", batch, kv_heads, keys, dim);
  Kokkos::View<S****, Kokkos::LayoutRight, Mem> kq("kq", batch, kv_heads, keys, dim),
      vq("vq", batch, kv_heads, keys, dim);
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> ksc("ks", batch, kv_heads, keys),
      vsc("vs", batch, kv_heads, keys);
  const Kokkos::LayoutStride l(batch, kb.stride(0), keys, kb.stride(2), kv_heads, kb.stride(1), dim,
                               1);
  const Kokkos::LayoutStride ls(batch, ksc.stride(0), keys, ksc.stride(2), kv_heads, ksc.stride(1));
  const Strided16 k(kb.data(), l), v(vb.data(), l);
  const StridedQ k8(kq.data(), l), v8(vq.data(), l);
  const StridedS ks(ksc.data(), ls), vs(vsc.data(), ls);
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> lse("lse", batch, heads, 1);
  Kokkos::View<int*, Mem> len("len", batch);
  Kokkos::View<blockattn::index_type*, Mem> qpos("qpos", batch);
  Kokkos::deep_copy(q, bf16(0.01f));
  Kokkos::deep_copy(kb, bf16(0.02f));
  Kokkos::deep_copy(vb, bf16(0.5f));
  Kokkos::deep_copy(kq, S(blockattn::impl::quantize<S>(40.0f)));
  Kokkos::deep_copy(vq, S(blockattn::impl::quantize<S>(100.0f)));
  Kokkos::deep_copy(ksc, 0.0005f);
  Kokkos::deep_copy(vsc, 0.005f);
  Kokkos::deep_copy(len, keys);
  Kokkos::deep_copy(qpos, blockattn::index_type(keys));
  blockattn::DecodeOptions opts;
  opts.max_length = keys;
  double t16 = 1e30, t8 = 1e30;
  for (int r = 0; r < reps; ++r) {
    t16 = std::min(t16, best_of(1, [&] {
                     blockattn::attention_decode(Exec{}, q, k, v, len, qpos, o, lse,
                                                 blockattn::CausalMask{},
                                                 blockattn::OffsetPositions{}, opts);
                   }));
    t8 = std::min(t8, best_of(1, [&] {
                    blockattn::attention_decode_quantized(Exec{}, q, k8, v8, ks, vs, len, qpos, o,
                                                          lse, blockattn::CausalMask{},
                                                          blockattn::OffsetPositions{}, opts);
                  }));
  }
  const double t_read = read_seconds(kq, vq, reps);
  const double bytes = 2.0 * double(kq.span()) * sizeof(S) + 2.0 * double(ksc.span()) * 4;
  std::printf("%-8s %5d %7d %3d %3d %4d %9.3f %9.3f %10.0f %10.0f %6.2f %8.2f %9.2f %6.2f\n",
              blockattn::quant_type_name<S>(), batch, keys, heads, kv_heads, dim, t16 * 1e3,
              t8 * 1e3, batch / t16, batch / t8, t16 / t8, bytes / t8 * 1e-9,
              2.0 * double(kq.span()) * sizeof(S) / t_read * 1e-9, t_read / t8);
}

/// A plain read of the pages of a (kv_heads, pages, page_size, dim) pool in
/// the order of `table` (batch, pages per sequence): each kv head's slots of
/// one page are one contiguous chunk, read where the table points.
template <class V, class Table>
double read_pages_seconds(const V& kp, const V& vp, const Table& table, int reps) {
  using S = typename V::non_const_value_type;
  const int heads = int(kp.extent(0)), per = int(table.extent(1));
  const std::int64_t chunks = std::int64_t(table.extent(0)) * per * heads;
  const std::int64_t words = std::int64_t(kp.extent(2) * kp.extent(3) * sizeof(S) / 8);
  return best_of(reps, [&] {
    std::uint64_t sum = 0;
    Kokkos::parallel_reduce(
        "bench::read_pages", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, chunks),
        KOKKOS_LAMBDA(const std::int64_t c, std::uint64_t& s) {
          const int g = int(c % heads), p = int((c / heads) % per), b = int(c / heads / per);
          const int page = table(b, p);
          const auto* pk = reinterpret_cast<const std::uint64_t*>(&kp(g, page, 0, 0));
          const auto* pv = reinterpret_cast<const std::uint64_t*>(&vp(g, page, 0, 0));
          std::uint64_t acc = 0;
          for (std::int64_t i = 0; i < words; ++i) acc += pk[i] ^ pv[i];
          s += acc;
        },
        sum);
    if (sum == 12345) std::printf(" ");
  });
}

/// A paged cache against the contiguous one (heads-major; the pool kv head
/// outermost, as PagedKVCache keeps it): the same keys in pages of `ps`
/// slots, in pool order (as a fresh pool or a prefill takes them) or
/// shuffled (a long-running server's pool), both decoded alternately, best of
/// reps each; x = contiguous time / paged time; read GB/s: a plain read of
/// the contiguous cache, and of the pages in the table's order.
template <class T>
void paged_rows(int batch, int keys, int heads, int kv_heads, int dim, int ps, bool shuffled,
                int reps) {
  using CT = blockattn::compute_t<T>;
  using Strided = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
  using Right = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  Right q("q", batch, 1, heads, dim), o("o", batch, 1, heads, dim);
  Right ks("k", batch, kv_heads, keys, dim), vs("v", batch, kv_heads, keys, dim);
  const Kokkos::LayoutStride l(batch, ks.stride(0), keys, ks.stride(2), kv_heads, ks.stride(1), dim,
                               1);
  const Strided k(ks.data(), l), v(vs.data(), l);
  const int per = (keys + ps - 1) / ps, pages = batch * per;
  Right kp("kp", kv_heads, pages, ps, dim), vp("vp", kv_heads, pages, ps, dim);
  const Kokkos::LayoutStride lp(pages, kp.stride(1), ps, kp.stride(2), kv_heads, kp.stride(0), dim,
                                1);
  const Strided kpv(kp.data(), lp), vpv(vp.data(), lp);
  Kokkos::View<int**, Mem> table("table", batch, per);
  auto th = Kokkos::create_mirror_view(table);
  std::vector<int> order(static_cast<std::size_t>(pages));
  for (int i = 0; i < pages; ++i) order[std::size_t(i)] = i;
  std::uint64_t x = 88172645463325252ull;  // xorshift: a fixed shuffle
  for (int i = shuffled ? pages - 1 : 0; i > 0; --i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::swap(order[std::size_t(i)], order[std::size_t(x % std::uint64_t(i + 1))]);
  }
  for (int b = 0; b < batch; ++b)
    for (int p = 0; p < per; ++p) th(b, p) = order[std::size_t(b * per + p)];
  Kokkos::deep_copy(table, th);
  Kokkos::View<CT***, Kokkos::LayoutRight, Mem> lse("lse", batch, heads, 1);
  Kokkos::View<int*, Mem> len("len", batch);
  Kokkos::View<blockattn::index_type*, Mem> qpos("qpos", batch);
  Kokkos::deep_copy(q, T(0.01f));
  Kokkos::deep_copy(ks, T(0.02f));
  Kokkos::deep_copy(vs, T(0.5f));
  Kokkos::deep_copy(kp, T(0.02f));
  Kokkos::deep_copy(vp, T(0.5f));
  Kokkos::deep_copy(len, keys);
  Kokkos::deep_copy(qpos, blockattn::index_type(keys));
  blockattn::DecodeOptions opts;
  opts.max_length = keys;
  double t_flat = 1e30, t_paged = 1e30;
  for (int r = 0; r < reps; ++r) {
    t_flat = std::min(t_flat, best_of(1, [&] {
                        blockattn::attention_decode(Exec{}, q, k, v, len, qpos, o, lse,
                                                    blockattn::CausalMask{},
                                                    blockattn::OffsetPositions{}, opts);
                      }));
    t_paged = std::min(t_paged, best_of(1, [&] {
                         blockattn::attention_decode_paged(Exec{}, q, kpv, vpv, table, len, qpos, o,
                                                           lse, blockattn::CausalMask{},
                                                           blockattn::OffsetPositions{}, opts);
                       }));
  }
  const double t_read = read_seconds(ks, vs, reps);
  const double t_pages = read_pages_seconds(kp, vp, table, reps);
  const double bytes = 2.0 * double(ks.span()) * sizeof(T);
  std::printf("%-5s %5d %-8s %5d %7d %3d %3d %4d %9.3f %9.3f %6.2f %8.2f %8.2f %8.2f %6.2f\n",
              blockattn::value_type_name<T>(), ps, shuffled ? "shuffled" : "pool", batch, keys,
              heads, kv_heads, dim, t_flat * 1e3, t_paged * 1e3, t_flat / t_paged,
              bytes / t_paged * 1e-9, bytes / t_read * 1e-9, bytes / t_pages * 1e-9,
              t_pages / t_paged);
}

/// One prefill chunk of `rows` rows after `cached` tokens of one sequence
/// (prefill_attention over a one-rank cache, causal; the append included),
/// with the decode kernel and with the forward's kernels, next to
/// attention_forward of the same rows against the same keys in contiguous
/// Views (q_offset = cached).
template <class T>
void prefill_rows(int cached, int rows, int heads, int kv_heads, int dim, int reps) {
  using CT = blockattn::compute_t<T>;
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  const int total = cached + rows;
  V4 q("q", 1, rows, heads, dim), o("o", 1, rows, heads, dim);
  V4 k("k", 1, total, kv_heads, dim), v("v", 1, total, kv_heads, dim);
  Kokkos::View<CT***, Kokkos::LayoutRight, Mem> lse("lse", 1, heads, rows);
  // Values of one scale, not constant (a constant row would make every tile alike).
  Kokkos::parallel_for(
      "bench::fill", Kokkos::RangePolicy<Exec>(0, int(k.size())), KOKKOS_LAMBDA(const int i) {
        k.data()[i] = T(float((i * 37) % 101) * 0.01f - 0.5f);
        v.data()[i] = T(float((i * 53) % 97) * 0.01f - 0.5f);
        if (i < int(q.size())) q.data()[i] = T(float((i * 29) % 89) * 0.01f - 0.4f);
      });
  const auto before = Kokkos::make_pair(0, cached), chunk = Kokkos::make_pair(cached, total);
  const auto k0 = Kokkos::subview(k, Kokkos::ALL, before, Kokkos::ALL, Kokkos::ALL);
  const auto v0 = Kokkos::subview(v, Kokkos::ALL, before, Kokkos::ALL, Kokkos::ALL);
  const auto k1 = Kokkos::subview(k, Kokkos::ALL, chunk, Kokkos::ALL, Kokkos::ALL);
  const auto v1 = Kokkos::subview(v, Kokkos::ALL, chunk, Kokkos::ALL, Kokkos::ALL);
  blockattn::SelfCommunicator comm;
  blockattn::KVCache<T, Exec> cache(comm, 1, total, kv_heads, dim);
  auto prefill = [&](int forward_rows) {
    blockattn::ServeOptions opts;
    opts.prefill_forward_rows = forward_rows;
    double best = 1e30;
    for (int r = 0; r <= reps; ++r) {  // the first: warm-up
      cache.clear(0);
      if (cached > 0) cache.append(Exec{}, 0, k0, v0);
      Kokkos::fence();
      const auto t0 = std::chrono::steady_clock::now();
      blockattn::prefill_attention(comm, Exec{}, cache, 0, q, k1, v1, o, lse,
                                   blockattn::CausalMask{}, opts);
      Kokkos::fence();
      if (r > 0) best = std::min(best, seconds_since(t0));
    }
    return best;
  };
  const double t_decode = prefill(std::numeric_limits<int>::max());
  const double t_forward = prefill(0);
  blockattn::ForwardOptions fo;
  fo.q_offset = cached;
  const double t_call = best_of(reps, [&] {
    blockattn::attention_forward(Exec{}, q, k, v, o, lse, blockattn::CausalMask{}, fo);
  });
  // Allowed pairs: every row sees the cached tokens and the chunk up to itself.
  const double flops = 4.0 * heads * dim * (double(rows) * cached + 0.5 * rows * (rows + 1.0));
  std::printf("%-5s %7d %6d %3d %3d %4d %10.3f %10.3f %10.3f %8.1f %8.1f %7.2f %7.2f\n",
              blockattn::value_type_name<T>(), cached, rows, heads, kv_heads, dim, t_decode * 1e3,
              t_forward * 1e3, t_call * 1e3, flops / t_decode * 1e-9, flops / t_forward * 1e-9,
              t_decode / t_forward, t_call / t_forward);
}

}  // namespace

const char* const usage_text = R"(usage: blockattn_bench_decode [flags]
Decode (serving) benchmarks: one query row per sequence against a cache of
--keys keys, causal, split-KV on one device (attention_decode): ms per step,
tokens/s, GB/s of K/V read, and a plain read of the same bytes in the same run
(read GB/s; ratio = decode's share of it).
  --keys N      cached keys per sequence [65536]
  --torch=FILE  PyTorch's times of the same shapes (bench/torch_decode.py, same
                threads, just before): columns torch ms and x torch (its time
                / ours: above 1, ours is faster)
  --prefill     chunked prefill instead: chunks of 1 .. 1024 rows after 4096
                and 16384 cached tokens (H = 8, kv heads 2, D = 128; fp32 and
                bf16), ms with the decode kernel, with the forward's kernels
                (ServeOptions::prefill_forward_rows) and of one attention_forward
                of the same rows and keys; GFLOP/s on allowed pairs
  --paged       a paged cache (attention_decode_paged; pages of 16, 64 and
                256 slots, in pool order and shuffled) next to the contiguous
                one: ms of each, x = contiguous / paged, GB/s, a plain read of
                the contiguous cache and of the pages in the table's order,
                ratio = paged decode's share of the latter
  --quant       8-bit caches (attention_decode_quantized: fp8_e4m3,
                fp8_e5m2, int8, bf16 queries) next to the bf16 cache of the
                same shape: ms and tokens/s of each, x = the 8-bit cache's
                tokens/s over bf16's, GB/s of its bytes, a plain read of its
                codes, ratio
  --batch B     sequences [1]
  --reps R      best of R [5]
  --help, -h    this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports.
)";

int main(int argc, char** argv) {
  return blockattn_cli::kokkos_main(argc, argv, "blockattn_bench_decode", usage_text, true, [&] {
    int keys = 65536, batch = 1, reps = 5;
    bool prefill = false, paged = false, quant = false;
    std::map<std::string, double> torch;
    std::string error;
    for (int i = 1; i < argc && error.empty(); ++i) {
      const std::string f = argv[i];
      if (f == "--prefill")
        prefill = true;
      else if (f == "--paged")
        paged = true;
      else if (f == "--quant")
        quant = true;
      else if (f.rfind("--torch=", 0) == 0) {
        if (!std::ifstream(f.substr(8))) error = "cannot read " + f.substr(8) + " (--torch)";
        torch = read_torch(f.substr(8));
      } else if (f != "--keys" && f != "--batch" && f != "--reps")
        error = "unknown argument " + f + " (blockattn_bench_decode --help lists the flags)";
      else if (i + 1 >= argc)
        error = f + " needs a value";
      else if (f == "--keys")
        error = blockattn_cli::read_int(f, argv[++i], keys, 1, 1 << 24);
      else if (f == "--batch")
        error = blockattn_cli::read_int(f, argv[++i], batch, 1, 4096);
      else
        error = blockattn_cli::read_int(f, argv[++i], reps);
    }
    if (!error.empty()) {
      std::fprintf(stderr, "blockattn_bench_decode: %s\n", error.c_str());
      return 2;
    }
    if (prefill) {
      std::printf(
          "Chunked prefill of one sequence on one device, causal, %d threads (%s); ms: the "
          "chunk's prefill_attention (its append included) on the decode kernel, on the "
          "forward's kernels, and one attention_forward of the same rows and keys; GFLOP/s on "
          "allowed pairs; x: decode / forward, call / forward\n",
          Exec{}.concurrency(), Exec::name());
      std::printf("%-5s %7s %6s %3s %3s %4s %10s %10s %10s %8s %8s %7s %7s\n", "type", "cached",
                  "rows", "H", "Hkv", "D", "ms decode", "ms fwd", "ms call", "GF dec", "GF fwd",
                  "x dec", "x call");
      for (int cached : {4096, 16384})
        for (int rows : {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 256, 1024}) {
          prefill_rows<float>(cached, rows, 8, 2, 128, reps);
          prefill_rows<blockattn::bf16>(cached, rows, 8, 2, 128, reps);
        }
      return 0;
    }
    if (quant) {
      std::printf(
          "Decode over 8-bit caches (attention_decode_quantized, one fp32 scale per row, "
          "heads-major) next to a bf16 cache of the same shape (attention_decode), bf16 "
          "queries, one row per sequence, causal, %d threads (%s); alternated, best of %d "
          "each; x = 8-bit tokens/s / bf16 tokens/s; ratio = the 8-bit decode's share of a "
          "plain read of its codes\n",
          Exec{}.concurrency(), Exec::name(), reps);
      std::printf("%-8s %5s %7s %3s %3s %4s %9s %9s %10s %10s %6s %8s %9s %6s\n", "cache", "B",
                  "keys", "H", "Hkv", "D", "ms bf16", "ms 8-bit", "tok/s bf16", "tok/s 8b", "x",
                  "GB/s", "read GB/s", "ratio");
      const int shapes[][3] = {{8, 8, 128}, {32, 8, 128}, {8, 1, 128}, {16, 16, 64}};
      for (const auto& sh : shapes) {
        quant_rows<blockattn::fp8_e4m3>(batch, keys, sh[0], sh[1], sh[2], reps);
        quant_rows<blockattn::fp8_e5m2>(batch, keys, sh[0], sh[1], sh[2], reps);
        quant_rows<std::int8_t>(batch, keys, sh[0], sh[1], sh[2], reps);
      }
      return 0;
    }
    if (paged) {
      std::printf(
          "Decode over a paged cache (attention_decode_paged) and over the same keys stored "
          "contiguously, one query row per sequence, causal, %d threads (%s), host matrix "
          "engine %s; the two alternated, best of %d each; x = contiguous ms / paged ms; read: "
          "a plain read of the contiguous cache, pages: of the pages in the table's order "
          "(GB/s); ratio = paged decode's share of the pages' read\n",
          Exec{}.concurrency(), Exec::name(), blockattn::host_matrix_engine().name(), reps);
      std::printf("%-5s %5s %-8s %5s %7s %3s %3s %4s %9s %9s %6s %8s %8s %8s %6s\n", "type", "page",
                  "order", "B", "keys", "H", "Hkv", "D", "ms contig", "ms paged", "x", "GB/s",
                  "read", "pages", "ratio");
      const int shapes[][3] = {{8, 8, 128}, {32, 8, 128}, {8, 1, 128}, {16, 16, 64}};
      for (const auto& sh : shapes)
        for (int ps : {16, 64, 256})
          for (bool shuffled : {false, true}) {
            paged_rows<float>(batch, keys, sh[0], sh[1], sh[2], ps, shuffled, reps);
            paged_rows<blockattn::bf16>(batch, keys, sh[0], sh[1], sh[2], ps, shuffled, reps);
          }
      return 0;
    }
    std::printf(
        "Decode, one query row per sequence, causal, %d threads (%s); host matrix "
        "engine %s (bf16 on AVX512-BF16 dot products where it is avx512-bf16; "
        "BLOCKATTN_HOST_MATRIX=off: the fp32 vectors); PyTorch: %s\n",
        Exec{}.concurrency(), Exec::name(), blockattn::host_matrix_engine().name(),
        torch.empty() ? "not run" : "scaled_dot_product_attention, same run, same threads");
    std::printf("%-5s %-5s %5s %7s %3s %3s %4s %10s %10s %9s %9s %6s %10s %7s\n", "type", "cache",
                "B", "keys", "H", "Hkv", "D", "ms/step", "tokens/s", "GB/s", "read GB/s", "ratio",
                "torch ms", "x torch");
    const int shapes[][3] = {{8, 8, 128}, {32, 8, 128}, {8, 1, 128}, {16, 16, 64}};
    for (const auto& s : shapes) {
      for (bool heads_major : {true, false}) {
        decode_rows<float>(batch, keys, s[0], s[1], s[2], reps, heads_major, torch);
        decode_rows<blockattn::bf16>(batch, keys, s[0], s[1], s[2], reps, heads_major, torch);
      }
    }
    return 0;
  });
}
