// SPDX-License-Identifier: Apache-2.0
// Decode benchmarks (serving): one query row per sequence against a long key
// cache, split-KV on one device, as tokens/s and as GB/s of K/V read, next to
// a plain read of the same bytes measured in the same run (decode is memory
// bound: the read is its ceiling).
#include <blockattn/blockattn.hpp>
#include <blockattn/kernel/decode.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
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

template <class T>
void decode_rows(int batch, int keys, int heads, int kv_heads, int dim, int reps,
                 bool heads_major) {
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
  std::printf("%-5s %-5s %5d %7d %3d %3d %4d %10.3f %10.1f %9.2f %9.2f %6.2f\n",
              blockattn::value_type_name<T>(), heads_major ? "heads" : "seq", batch, keys, heads,
              kv_heads, dim, t_dec * 1e3, batch / t_dec, bytes / t_dec * 1e-9,
              bytes / t_read * 1e-9, t_read / t_dec);
}

}  // namespace

const char* const usage_text = R"(usage: blockattn_bench_decode [flags]
Decode (serving) benchmarks: one query row per sequence against a cache of
--keys keys, causal, split-KV on one device (attention_decode): ms per step,
tokens/s, GB/s of K/V read, and a plain read of the same bytes in the same run
(read GB/s; ratio = decode's share of it).
  --keys N      cached keys per sequence [65536]
  --batch B     sequences [1]
  --reps R      best of R [5]
  --help, -h    this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports.
)";

int main(int argc, char** argv) {
  if (blockattn_cli::wants_help(argc, argv)) {  // before Kokkos, which has its own --help
    std::fputs(usage_text, stdout);
    return 0;
  }
  Kokkos::initialize(argc, argv);
  const int rc = blockattn_cli::run_guarded("blockattn_bench_decode", true, [&] {
    int keys = 65536, batch = 1, reps = 5;
    std::string error;
    for (int i = 1; i < argc && error.empty(); ++i) {
      const std::string f = argv[i];
      if (f != "--keys" && f != "--batch" && f != "--reps")
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
    std::printf("Decode, one query row per sequence, causal, %d threads (%s)\n",
                Exec{}.concurrency(), Exec::name());
    std::printf("%-5s %-5s %5s %7s %3s %3s %4s %10s %10s %9s %9s %6s\n", "type", "cache", "B",
                "keys", "H", "Hkv", "D", "ms/step", "tokens/s", "GB/s", "read GB/s", "ratio");
    const int shapes[][3] = {{8, 8, 128}, {32, 8, 128}, {8, 1, 128}, {16, 16, 64}};
    for (const auto& s : shapes) {
      for (bool heads_major : {true, false}) {
        decode_rows<float>(batch, keys, s[0], s[1], s[2], reps, heads_major);
        decode_rows<blockattn::bf16>(batch, keys, s[0], s[1], s[2], reps, heads_major);
      }
    }
    return 0;
  });
  Kokkos::finalize();
  return rc;
}
