// SPDX-License-Identifier: Apache-2.0
// BlockAttn demo: exact blockwise attention on one device for several masks.
// For each mask it runs the tile kernel, checks sampled rows against an fp64
// reference, and prints time, GFLOP/s on allowed pairs, the tile classifier's
// work (full / partial / skipped tiles) and the error; then the same as JSON lines.
//
//   blockattn_demo [--n N] [--d D] [--heads H] [--batch B] [--fp64] [--reps R]
#include <blockattn/blockattn.hpp>

#include "../tools/cli_args.hpp"  // strict numbers, --help

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Args {
  int n = 4096, d = 128, heads = 4, batch = 1, reps = 3;
  bool fp64 = false;
};

const char* const usage_text = R"(usage: blockattn_demo_single [flags]
Exact blockwise attention on one device for several masks, checked against an
fp64 reference: time, GFLOP/s on allowed pairs, tiles and error per mask.
  --n N        sequence length [4096]
  --d D        head dim, 1 .. 256 [128]
  --heads H    [4]
  --batch B    [1]
  --reps R     best of R [3]
  --fp64       fp64 values (default fp32)
  --help, -h   this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through.
)";

[[noreturn]] void bad(const std::string& what) {
  std::fprintf(stderr, "blockattn_demo_single: %s (--help lists the flags)\n", what.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* flag) {
      if (i + 1 >= argc) bad(std::string("missing value after ") + flag);
      int v = 0;
      const std::string error = blockattn_cli::read_int(flag, argv[++i], v);
      if (!error.empty()) bad(error);
      return v;
    };
    if (!std::strcmp(argv[i], "--n"))
      a.n = next("--n");
    else if (!std::strcmp(argv[i], "--d"))
      a.d = next("--d");
    else if (!std::strcmp(argv[i], "--heads"))
      a.heads = next("--heads");
    else if (!std::strcmp(argv[i], "--batch"))
      a.batch = next("--batch");
    else if (!std::strcmp(argv[i], "--reps"))
      a.reps = next("--reps");
    else if (!std::strcmp(argv[i], "--fp64"))
      a.fp64 = true;
    else if (std::strncmp(argv[i], "--kokkos", 8))
      bad(std::string("unknown option ") + argv[i]);
  }
  return a;
}

struct Row {
  std::string mask;
  double seconds, gflops, max_err, tol;
  blockattn::TileCounts tiles;
};

template <class T, class Mask>
Row run(const Args& a, const char* name, const Mask& mask) {
  using View4 = Kokkos::View<T****>;
  View4 q("q", a.batch, a.n, a.heads, a.d), k("k", a.batch, a.n, a.heads, a.d),
      v("v", a.batch, a.n, a.heads, a.d), o("o", a.batch, a.n, a.heads, a.d);
  Kokkos::View<T***> lse("lse", a.batch, a.heads, a.n);
  auto qh = Kokkos::create_mirror_view(q), kh = Kokkos::create_mirror_view(k),
       vh = Kokkos::create_mirror_view(v);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (std::size_t i = 0; i < qh.size(); ++i) {
    qh.data()[i] = T(u(rng));
    kh.data()[i] = T(u(rng));
    vh.data()[i] = T(u(rng));
  }
  Kokkos::deep_copy(q, qh);
  Kokkos::deep_copy(k, kh);
  Kokkos::deep_copy(v, vh);

  double best = 1e30;
  for (int r = 0; r < a.reps + 1; ++r) {  // first run warms up
    Kokkos::fence();
    const auto t0 = std::chrono::steady_clock::now();
    blockattn::attention_forward(q, k, v, o, lse, mask);
    Kokkos::fence();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, t);
  }

  // fp64 reference on sampled rows (first, last, and spread in between).
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  const double scale = 1.0 / std::sqrt(double(a.d));
  double err = 0.0;
  std::vector<double> s(a.n);
  for (int b = 0; b < a.batch; ++b)
    for (int h = 0; h < a.heads; ++h)
      for (int sample = 0; sample < 16; ++sample) {
        const int i = sample == 15 ? a.n - 1 : int((long long)(a.n - 1) * sample / 15);
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < a.n; ++j) {
          double dot = 0.0;
          for (int c = 0; c < a.d; ++c) dot += double(qh(b, i, h, c)) * double(kh(b, j, h, c));
          s[j] = mask.allowed(i, j) ? scale * dot : -INFINITY;
          mx = std::max(mx, s[j]);
        }
        for (int j = 0; j < a.n; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int c = 0; c < a.d; ++c) {
          double acc = 0.0;
          for (int j = 0; j < a.n; ++j) acc += s[j] * double(vh(b, j, h, c));
          err = std::max(err, std::abs(acc / sum - double(oh(b, i, h, c))));
        }
      }

  const blockattn::TileSizes ts = blockattn::forward_tile_sizes<T>(a.d);
  blockattn::TileCounts tiles = blockattn::count_tiles(mask, a.n, a.n, ts.block_q, ts.block_k);
  const double heads = double(a.batch) * a.heads;
  const double flops = heads * blockattn::forward_flops(tiles.allowed_pairs, a.d);
  // Same budget as the tests: 8 eps (sqrt(D) * logit condition + sqrt(N) + 1),
  // with the condition bounded by scale * D for inputs in [-1, 1].
  const double eps = std::numeric_limits<T>::epsilon();
  const double tol =
      8.0 * eps * (std::sqrt(double(a.d)) * scale * a.d + std::sqrt(double(a.n)) + 1.0);
  return Row{name, best, flops / best * 1e-9, err, tol, tiles};
}

template <class T>
int run_all(const Args& a) {
  std::vector<Row> rows;
  rows.push_back(run<T>(a, "full", blockattn::FullMask{}));
  rows.push_back(run<T>(a, "causal", blockattn::CausalMask{}));
  rows.push_back(run<T>(a, "window(512)", blockattn::causal_window(512)));
  rows.push_back(run<T>(a, "window(-256,+256)", blockattn::SlidingWindowMask{256, 256}));

  std::printf("BlockAttn demo: Kokkos %s (%d threads), %s, B=%d H=%d N=%d D=%d\n",
              Kokkos::DefaultExecutionSpace::name(), Kokkos::DefaultExecutionSpace().concurrency(),
              a.fp64 ? "fp64" : "fp32", a.batch, a.heads, a.n, a.d);
  std::printf("tiles are per (batch, head), %dx%d each; GFLOP/s counts 4*D per allowed pair\n",
              blockattn::forward_tile_sizes<T>(a.d).block_q,
              blockattn::forward_tile_sizes<T>(a.d).block_k);
  std::printf("%-18s %10s %10s %8s %8s %8s %10s %10s %s\n", "mask", "time[ms]", "GFLOP/s", "full",
              "partial", "skipped", "max_err", "tolerance", "check");
  int failures = 0;
  for (const Row& r : rows) {
    const bool ok = r.max_err <= r.tol;
    failures += !ok;
    std::printf("%-18s %10.2f %10.1f %8lld %8lld %8lld %10.2e %10.2e %s\n", r.mask.c_str(),
                r.seconds * 1e3, r.gflops, (long long)r.tiles.full, (long long)r.tiles.partial,
                (long long)r.tiles.skipped, r.max_err, r.tol, ok ? "OK" : "FAIL");
  }
  for (const Row& r : rows)
    std::printf(
        "{\"mask\":\"%s\",\"dtype\":\"%s\",\"backend\":\"%s\",\"threads\":%d,\"batch\":%d,"
        "\"heads\":%d,\"n\":%d,\"d\":%d,\"seconds\":%.6g,\"gflops\":%.4g,\"tiles_full\":%lld,"
        "\"tiles_partial\":%lld,\"tiles_skipped\":%lld,\"allowed_pairs\":%lld,\"max_err\":%.3g}\n",
        r.mask.c_str(), a.fp64 ? "fp64" : "fp32", Kokkos::DefaultExecutionSpace::name(),
        Kokkos::DefaultExecutionSpace().concurrency(), a.batch, a.heads, a.n, a.d, r.seconds,
        r.gflops, (long long)r.tiles.full, (long long)r.tiles.partial, (long long)r.tiles.skipped,
        (long long)r.tiles.allowed_pairs, r.max_err);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  if (blockattn_cli::wants_help(argc, argv)) {  // before Kokkos, which has its own --help
    std::fputs(usage_text, stdout);
    return 0;
  }
  Kokkos::initialize(argc, argv);
  int failures = 0;
  try {
    const Args a = parse(argc, argv);
    failures = a.fp64 ? run_all<double>(a) : run_all<float>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "blockattn_demo_single: %s\n", e.what());
    failures = -1;
  }
  Kokkos::finalize();
  return failures == 0 ? 0 : failures < 0 ? 2 : 1;
}
