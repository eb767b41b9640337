// SPDX-License-Identifier: Apache-2.0
// Forward and backward throughput of the tile kernels vs an fp32 GEMM of the
// same size and vs PyTorch's CPU scaled_dot_product_attention, in one run,
// for each value type of --dtype=fp32,bf16,fp16 (default fp32,bf16: 16-bit
// storage, fp32 compute; the 16-bit rates are also given relative to fp32).
//
// GFLOP/s counts 4 * D per *allowed* query-key pair (masked pairs are not
// work). The reference GEMM is cblas_sgemm of the Q K^T shape (N x N x D) and
// a 4096^3 sgemm (the machine's GEMM peak), with as many BLAS threads as
// Kokkos has. Google Benchmark's table gives the mean iteration ("GFLOP/s")
// and the fastest ("best GFLOP/s"); the ratios use the fastest of every
// case, ours, OpenBLAS's and PyTorch's alike (bench/torch_sdpa.py reports
// PyTorch's fastest repetition). After Google Benchmark's table the binary prints, per case,
// attention GFLOP/s / GEMM GFLOP/s and causal / full, and with --torch=FILE
// (written by bench/torch_sdpa.py just before, same thread count) PyTorch's
// rate on the same case and our ratio to it.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <blockattn/blockattn.hpp>

#include "../tools/cli_args.hpp"
#ifdef BLOCKATTN_BENCH_HAVE_KOKKOS_KERNELS
#include <blockattn/kokkos_kernels_gemm.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
constexpr bool host = std::is_same<Exec::memory_space, Kokkos::HostSpace>::value;

enum MaskId { full = 0, causal = 1 };

/// Query heads (= K/V heads) of every attention case (--heads); B = 1.
int g_heads = 1;
bool g_invariant = false;  // --invariant: also the invariant mode's forward

/// Memory order of q, k, v, o, dO and the gradients (--layout): the Views are
/// (batch, seq, heads, dim) either way, LayoutStride over memory laid out
///   bnhd  [batch][seq][heads][dim]  (the default: a projection's output
///         viewed per head, flash_attn's layout; rows of one head are
///         heads * dim apart)
///   bhnd  [batch][heads][seq][dim]  (each head's rows contiguous: PyTorch's
///         (B, H, N, D) contiguous tensors)
/// bench/torch_sdpa.py --layout hands PyTorch the same memory.
bool g_head_major = false;

/// A (1, n, h, d) View of the layout --layout names.
template <class V>
Kokkos::View<V****, Kokkos::LayoutStride> bench_view(const char* label, int n, int h, int d) {
  const std::size_t nd = std::size_t(n) * d, hd = std::size_t(h) * d;
  return Kokkos::View<V****, Kokkos::LayoutStride>(
      std::string(label), Kokkos::LayoutStride(1, nd * h, n, g_head_major ? std::size_t(d) : hd, h,
                                               g_head_major ? nd : std::size_t(d), d, 1));
}

/// Uniform [-1, 1) values, rounded to the View's value type.
template <class View>
void fill(const View& view, unsigned seed) {
  using V = typename View::non_const_value_type;
  auto h = Kokkos::create_mirror_view(view);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = V(u(rng));
  Kokkos::deep_copy(view, h);
}

/// Google Benchmark's minimum time per case (seconds): iterations until their
/// manual times add up to it.
constexpr double min_time = 0.3;
constexpr double peak_min_time = 0.5;  // sgemm 4096^3

/// Runs and times each iteration of `run` (manual time); returns the fastest.
/// Google Benchmark stops after one iteration when that one takes its minimum
/// time `min_s`; then a second call is timed too (outside its mean), so that
/// the fastest is always of at least two, as PyTorch's (bench/torch_sdpa.py).
/// A one-iteration trial shorter than `min_s` is not reported (a longer trial
/// follows), so it gets no second call.
template <class Run>
double time_iterations(benchmark::State& state, const Run& run, double min_s = min_time) {
  auto seconds = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double best = std::numeric_limits<double>::infinity();
  for (auto _ : state) {
    const double s = seconds();
    state.SetIterationTime(s);
    best = std::min(best, s);
  }
  if (state.iterations() < 2 && best >= min_s) best = std::min(best, seconds());
  return best;
}

/// "GFLOP/s": over the mean iteration (Google Benchmark's time column);
/// "best GFLOP/s": over the fastest one, the rate the ratios below use, as
/// bench/torch_sdpa.py reports PyTorch's fastest repetition.
void set_rates(benchmark::State& state, double gflop, double best_seconds) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(gflop, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["best GFLOP/s"] = benchmark::Counter(gflop / best_seconds);
}

/// The invariant mode (ForwardOptions::invariant) in place of a tile shape.
struct InvariantMode {};

template <class Shape, class V>
void bm_attention(benchmark::State& state) {
  const int n = int(state.range(0)), d = int(state.range(1));
  const MaskId mask = MaskId(state.range(2));
  const int h = g_heads;
  const auto q = bench_view<V>("q", n, h, d), k = bench_view<V>("k", n, h, d),
             v = bench_view<V>("v", n, h, d), o = bench_view<V>("o", n, h, d);
  Kokkos::View<blockattn::compute_t<V>***> lse("lse", 1, h, n);
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  // The default shape through the public call users make (its block
  // product, precompiled or not); other shapes through the shape entry point.
  auto forward = [&](const auto& m) {
    if constexpr (std::is_same<Shape, InvariantMode>::value) {
      blockattn::ForwardOptions opts;
      opts.invariant = true;
      blockattn::attention_forward(Exec{}, q, k, v, o, lse, m, opts);
    } else if constexpr (std::is_same<Shape, blockattn::DefaultTileShape<float, host>>::value)
      blockattn::attention_forward(Exec{}, q, k, v, o, lse, m);
    else
      blockattn::attention_forward_with_shape<Shape>(Exec{}, q, k, v, o, lse, m);
  };
  auto run = [&] {
    if (mask == causal)
      forward(blockattn::CausalMask{});
    else
      forward(blockattn::FullMask{});
    Kokkos::fence();
  };
  run();  // warm-up
  const double best = time_iterations(state, run);
  using SizesOf = std::conditional_t<std::is_same<Shape, InvariantMode>::value,
                                     blockattn::DefaultTileShape<float, host>, Shape>;
  const blockattn::TileSizes ts = blockattn::forward_tile_sizes<float, Exec, SizesOf>(d);
  const blockattn::TileCounts tiles =
      mask == causal ? blockattn::count_tiles(blockattn::CausalMask{}, n, n, ts.block_q, ts.block_k)
                     : blockattn::count_tiles(blockattn::FullMask{}, n, n, ts.block_q, ts.block_k);
  set_rates(state, double(h) * blockattn::forward_flops(tiles.allowed_pairs, d) * 1e-9, best);
  state.counters["threads"] = Exec().concurrency();
  if constexpr (std::is_same<Shape, InvariantMode>::value)
    state.SetLabel(std::string(mask == causal ? "causal " : "full ") +
                   blockattn::value_type_name<V>() + " invariant");
  else
    state.SetLabel(std::string(mask == causal ? "causal " : "full ") +
                   blockattn::value_type_name<V>() + " " + Shape::tile_gemm::name());
}

/// Backward: dQ, dK, dV from the saved O and LSE. GFLOP/s counts 2.5x the
/// forward's FLOPs on allowed pairs (FlashAttention's convention: 5 of the
/// forward's 2 tile products), although our two-kernel backward computes 7.
template <class V, bool Invariant = false>
void bm_backward(benchmark::State& state) {
  const int n = int(state.range(0)), d = int(state.range(1));
  const MaskId mask = MaskId(state.range(2));
  const int h = g_heads;
  const auto q = bench_view<V>("q", n, h, d), k = bench_view<V>("k", n, h, d),
             v = bench_view<V>("v", n, h, d), o = bench_view<V>("o", n, h, d),
             dout = bench_view<V>("do", n, h, d), dq = bench_view<V>("dq", n, h, d),
             dk = bench_view<V>("dk", n, h, d), dv = bench_view<V>("dv", n, h, d);
  Kokkos::View<blockattn::compute_t<V>***> lse("lse", 1, h, n);
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  fill(dout, 4);
  blockattn::ForwardOptions opts;
  opts.invariant = Invariant;
  auto run = [&](bool backward) {
    if (mask == causal) {
      if (backward)
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv,
                                      blockattn::CausalMask{}, opts);
      else
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, blockattn::CausalMask{}, opts);
    } else {
      if (backward)
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv,
                                      blockattn::FullMask{}, opts);
      else
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, blockattn::FullMask{}, opts);
    }
    Kokkos::fence();
  };
  run(false);
  run(true);
  const double best = time_iterations(state, [&] { run(true); });
  const std::int64_t pairs = mask == causal ? std::int64_t(n) * (n + 1) / 2 : std::int64_t(n) * n;
  set_rates(state, 2.5 * double(h) * blockattn::forward_flops(pairs, d) * 1e-9, best);
  state.counters["threads"] = Exec().concurrency();
  state.SetLabel(std::string(mask == causal ? "causal backward " : "full backward ") +
                 blockattn::value_type_name<V>() + (Invariant ? " invariant" : ""));
}

void bm_sgemm(benchmark::State& state) {
  const int m = int(state.range(0)), nn = int(state.range(1)), kk = int(state.range(2));
  std::vector<float> a(std::size_t(m) * kk, 0.5f), b(std::size_t(nn) * kk, 0.25f),
      c(std::size_t(m) * nn);
  openblas_set_num_threads(Exec().concurrency());
  auto run = [&] {
    // C = A B^T: the Q K^T product of attention when kk = head dim.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nn, kk, 1.f, a.data(), kk, b.data(), kk,
                0.f, c.data(), nn);
  };
  run();
  const double best = time_iterations(state, run, state.range(3) * 1e-3);
  set_rates(state, 2.0 * m * nn * kk * 1e-9, best);
  state.counters["threads"] = Exec().concurrency();
}

/// Keeps every run's best GFLOP/s (its fastest iteration) to print the ratios
/// at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> rate;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      auto it = r.counters.find("best GFLOP/s");
      if (it != r.counters.end() && r.run_type == Run::RT_Iteration)
        rate[r.run_name.function_name] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

using RegisterShape = blockattn::DefaultTileShape<float, host>;
#ifdef BLOCKATTN_BENCH_HAVE_KOKKOS_KERNELS
using BatchedShape = blockattn::KokkosBatchedTileShape<float, host>;
#endif

const std::vector<int> lengths = {512, 1024, 2048, 4096, 16384};
const std::vector<int> dims = {64, 128};

std::string attn_name(const char* variant, const std::string& dtype, int n, int d, int mask) {
  return std::string("attention/") + variant + "/" + dtype + "/N:" + std::to_string(n) +
         "/D:" + std::to_string(d) + (mask == causal ? "/causal" : "/full");
}

std::string bwd_name(const std::string& dtype, int n, int d, int mask) {
  return "backward/" + dtype + "/N:" + std::to_string(n) + "/D:" + std::to_string(d) +
         (mask == causal ? "/causal" : "/full");
}

std::string gemm_name(int n, int d) {
  return "sgemm/M:" + std::to_string(n) + "/N:" + std::to_string(n) + "/K:" + std::to_string(d);
}

/// Manual time in ms, iterations for at least `min_s` seconds
/// (time_iterations adds a second call where one takes longer).
benchmark::internal::Benchmark* timed(benchmark::internal::Benchmark* b, double min_s = min_time) {
  return b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(min_s);
}

template <class V>
void register_dtype(int n, int d) {
  const std::string dt = blockattn::value_type_name<V>();
  for (int mask : {full, causal}) {
    timed(benchmark::RegisterBenchmark(attn_name("register", dt, n, d, mask).c_str(),
                                       bm_attention<RegisterShape, V>)
              ->Args({n, d, mask}));
    if (g_invariant)
      timed(benchmark::RegisterBenchmark(attn_name("invariant", dt, n, d, mask).c_str(),
                                         bm_attention<InvariantMode, V>)
                ->Args({n, d, mask}));
#ifdef BLOCKATTN_BENCH_HAVE_KOKKOS_KERNELS
    if (n <= 1024 && std::is_same<V, float>::value)  // the slower variant: one size is enough
      timed(benchmark::RegisterBenchmark(attn_name("kokkos_batched", dt, n, d, mask).c_str(),
                                         bm_attention<BatchedShape, V>)
                ->Args({n, d, mask}));
#endif
  }
  for (int mask : {full, causal}) {
    timed(benchmark::RegisterBenchmark(bwd_name(dt, n, d, mask).c_str(), bm_backward<V>)
              ->Args({n, d, mask}));
    if (g_invariant)
      timed(benchmark::RegisterBenchmark(("invariant_" + bwd_name(dt, n, d, mask)).c_str(),
                                         bm_backward<V, true>)
                ->Args({n, d, mask}));
  }
}

void register_all(bool quick, const std::vector<std::string>& dtypes) {
  for (int d : dims)
    for (int n : lengths) {
      if (quick && n > 4096) continue;
      for (const std::string& dt : dtypes) {
        if (dt == "fp32")
          register_dtype<float>(n, d);
        else if (dt == "bf16")
          register_dtype<blockattn::bf16>(n, d);
        else if (dt == "fp16")
          register_dtype<blockattn::fp16>(n, d);
      }
      timed(benchmark::RegisterBenchmark(gemm_name(n, d).c_str(), bm_sgemm)
                ->Args({n, n, d, int(min_time * 1e3)}));
    }
  // The 4th argument: the minimum time in ms (time_iterations needs it too).
  timed(benchmark::RegisterBenchmark("sgemm/4096^3", bm_sgemm)
            ->Args({4096, 4096, 4096, int(peak_min_time * 1e3)}),
        peak_min_time);
}

/// PyTorch's rates from bench/torch_sdpa.py: "<fwd|bwd> N D mask dtype GFLOP/s" per line.
std::map<std::string, double> read_torch(const std::string& path) {
  std::map<std::string, double> r;
  std::ifstream in(path);
  std::string op, mask, dtype;
  int n = 0, d = 0;
  double g = 0;
  while (in >> op >> n >> d >> mask >> dtype >> g)
    r[op + "/" + dtype + "/" + std::to_string(n) + "/" + std::to_string(d) + "/" + mask] = g;
  return r;
}

std::string torch_key(const char* op, const std::string& dtype, int n, int d, int mask) {
  return std::string(op) + "/" + dtype + "/" + std::to_string(n) + "/" + std::to_string(d) +
         (mask == causal ? "/causal" : "/full");
}

/// num / den to two decimals, rounded (std::to_string(x).substr(0, 4) truncated
/// them, and so printed 0.999 as 0.99); "-" where den was not measured.
std::string ratio(double num, double den) {
  if (!(den > 0) || !(num > 0)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", num / den);
  return buf;
}

}  // namespace

const char* const usage_text = R"(usage: blockattn_bench_forward [flags]
Forward and backward GFLOP/s of the tile kernels next to an sgemm of the same
size, a 4096^3 sgemm and (with --torch) PyTorch's CPU SDPA, in one run.
  --quick             fewer shapes and repetitions
  --dtype=T,..        fp32, bf16, fp16 [fp32,bf16]
  --heads=H           query (= K/V) heads of every attention case, B = 1 [1]
  --layout=L          memory order of q, k, v, o: bnhd ([seq][heads][dim]) or
                      bhnd ([heads][seq][dim], PyTorch's contiguous (B, H, N, D)) [bnhd]
  --buffer-cache-mb=M host memory the calls keep cached between calls, MiB
                      (set_buffer_cache_limit) [the library's default]
  --torch=FILE        PyTorch's rates (bench/torch_sdpa.py, same threads, just before)
  --invariant         also the invariant mode's forward (ForwardOptions::invariant),
                      its rate next to the default's ("/ default")
  --help, -h          this text
Google Benchmark's flags (--benchmark_filter=REGEX, --benchmark_repetitions=N,
--benchmark_format=json, ...) and Kokkos' (--kokkos-num-threads=N) pass through;
any other flag is an error (exit status 2). bench/run_forward.sh runs it with
PyTorch next to it.
)";

int main(int argc, char** argv) {
  return blockattn_cli::kokkos_main(argc, argv, "blockattn_bench_forward", usage_text, true, [&] {
    bool quick = false;
    std::map<std::string, double> torch;
    std::vector<std::string> dtypes = {"fp32", "bf16"};
    std::vector<char*> args;
    for (int i = 0; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick")
        quick = true;
      else if (a == "--invariant")
        g_invariant = true;
      else if (a.rfind("--torch=", 0) == 0)
        torch = read_torch(a.substr(8));
      else if (a.rfind("--dtype=", 0) == 0)
        dtypes = blockattn_cli::split(a.substr(8));
      else if (a.rfind("--heads=", 0) == 0) {
        g_heads = std::atoi(a.c_str() + 8);
        if (g_heads < 1 || g_heads > 1024) {
          std::fprintf(stderr, "blockattn_bench_forward: --heads: '%s' is not 1 to 1024\n",
                       a.c_str() + 8);
          return 2;
        }
      } else if (a.rfind("--buffer-cache-mb=", 0) == 0) {
        const std::string m = a.substr(18);
        char* end = nullptr;
        const long mb = std::strtol(m.c_str(), &end, 10);
        if (m.empty() || *end != '\0' || mb < 0 || mb > (1L << 20)) {
          std::fprintf(stderr,
                       "blockattn_bench_forward: --buffer-cache-mb: '%s' is not 0 to 1048576\n",
                       m.c_str());
          return 2;
        }
        blockattn::set_buffer_cache_limit(std::size_t(mb) << 20);
      } else if (a.rfind("--layout=", 0) == 0) {
        const std::string l = a.substr(9);
        if (l != "bnhd" && l != "bhnd") {
          std::fprintf(stderr, "blockattn_bench_forward: --layout: '%s' is not bnhd or bhnd\n",
                       l.c_str());
          return 2;
        }
        g_head_major = l == "bhnd";
      } else
        args.push_back(argv[i]);
    }
    for (const std::string& dt : dtypes)
      if (dt != "fp32" && dt != "bf16" && dt != "fp16") {
        std::fprintf(stderr,
                     "blockattn_bench_forward: --dtype: '%s' is not one of fp32, bf16, fp16\n",
                     dt.c_str());
        return 2;
      }
    int bargc = int(args.size());
    benchmark::Initialize(&bargc, args.data());
    // What neither Google Benchmark nor we took is a mistake, not a no-op.
    if (bargc > 1) {
      std::fprintf(stderr,
                   "blockattn_bench_forward: unknown argument %s (blockattn_bench_forward --help "
                   "lists the flags)\n",
                   args[1]);
      return 2;
    }
    register_all(quick, dtypes);
    RatioReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);

    const int threads = Exec().concurrency();
    const double peak = reporter.rate["sgemm/4096^3"];
    char peak_buf[48];
    std::snprintf(peak_buf, sizeof peak_buf, "%.1f GFLOP/s", peak);
    const std::string peak_text = peak > 0 ? peak_buf : "not run";
    auto rate = [&](const std::string& name) {
      auto it = reporter.rate.find(name);
      return it == reporter.rate.end() ? 0.0 : it->second;
    };
    auto torch_rate = [&](const std::string& key) {
      auto it = torch.find(key);
      return it == torch.end() ? 0.0 : it->second;
    };
    std::printf(
        "\nRatios measured in this run (%s, %d thread%s; B = 1, H = %d, memory %s; host ISA %s, "
        "fp32 "
        "kernels run %s; host matrix engine %s%s%s; sgemm 4096^3 = %s; PyTorch: %s; every rate "
        "from the case's fastest iteration, PyTorch's from its fastest repetition; 16-bit types "
        "are stored in 16 bits and computed in fp32, the bf16 forward on the matrix engine where "
        "it runs; \"/ fp32\" is our rate over our fp32 rate on the same case)\n",
        Exec::name(), threads, threads == 1 ? "" : "s", g_heads, g_head_major ? "bhnd" : "bnhd",
        blockattn::host_isa_name(), blockattn::host_isa_name(blockattn::dispatched_host_isa()),
        blockattn::host_matrix_engine().name(),
        blockattn::host_matrix_engine().reason.empty() ? "" : ": ",
        blockattn::host_matrix_engine().reason.c_str(), peak_text.c_str(),
        torch.empty() ? "not run" : "same run, same threads, same dtype");
    std::printf("%-15s %5s %5s %5s %7s %9s %8s %9s %8s %7s %9s %8s\n", "variant", "dtype", "N", "D",
                "mask", "GFLOP/s", "/sgemm", "/sgemm4k", "c/f", "/ fp32", "torch", "/ torch");
    for (const char* variant : {"register", "kokkos_batched"})
      for (int d : dims)
        for (int n : lengths)
          for (int mask : {full, causal})
            for (const std::string& dt : dtypes) {
              const double r = rate(attn_name(variant, dt, n, d, mask));
              if (r == 0.0) continue;
              const double g = rate(gemm_name(n, d));
              const double f = rate(attn_name(variant, dt, n, d, full));
              const double r32 = rate(attn_name(variant, "fp32", n, d, mask));
              const double tr = torch_rate(torch_key("fwd", dt, n, d, mask));
              std::printf("%-15s %5s %5d %5d %7s %9.1f %8s %9s %8s %7s %9.1f %8s\n", variant,
                          dt.c_str(), n, d, mask == causal ? "causal" : "full", r,
                          ratio(r, g).c_str(), ratio(r, peak).c_str(),
                          mask == causal ? ratio(r, f).c_str() : "",
                          dt != "fp32" ? ratio(r, r32).c_str() : "", tr, ratio(r, tr).c_str());
            }
    if (g_invariant) {
      std::printf(
          "\nInvariant mode (ForwardOptions::invariant, tile 64): its forward next to the "
          "default forward of the same case\n");
      std::printf("%8s %5s %5s %5s %7s %9s %10s\n", "pass", "dtype", "N", "D", "mask", "GFLOP/s",
                  "/ default");
      for (int d : dims)
        for (int n : lengths)
          for (int mask : {full, causal})
            for (const std::string& dt : dtypes) {
              const double r = rate(attn_name("invariant", dt, n, d, mask));
              const double f = rate(attn_name("register", dt, n, d, mask));
              const double rb = rate("invariant_" + bwd_name(dt, n, d, mask));
              const double fb = rate(bwd_name(dt, n, d, mask));
              if (r > 0.0)
                std::printf("%8s %5s %5d %5d %7s %9.1f %10s\n", "forward", dt.c_str(), n, d,
                            mask == causal ? "causal" : "full", r, ratio(r, f).c_str());
              if (rb > 0.0)
                std::printf("%8s %5s %5d %5d %7s %9.1f %10s\n", "backward", dt.c_str(), n, d,
                            mask == causal ? "causal" : "full", rb, ratio(rb, fb).c_str());
            }
    }
    std::printf("\nBackward (dQ, dK, dV; GFLOP/s = 2.5 x forward FLOPs on allowed pairs)\n");
    std::printf("%5s %5s %5s %7s %9s %8s %9s %8s %7s %9s %8s\n", "dtype", "N", "D", "mask",
                "GFLOP/s", "/sgemm", "/sgemm4k", "b/f time", "/ fp32", "torch", "/ torch");
    for (int d : dims)
      for (int n : lengths)
        for (int mask : {full, causal})
          for (const std::string& dt : dtypes) {
            const double r = rate(bwd_name(dt, n, d, mask));
            if (r == 0.0) continue;
            const double g = rate(gemm_name(n, d));
            const double f = rate(attn_name("register", dt, n, d, mask));
            const double r32 = rate(bwd_name("fp32", n, d, mask));
            const double tr = torch_rate(torch_key("bwd", dt, n, d, mask));
            std::printf("%5s %5d %5d %7s %9.1f %8s %9s %8s %7s %9.1f %8s\n", dt.c_str(), n, d,
                        mask == causal ? "causal" : "full", r, ratio(r, g).c_str(),
                        ratio(r, peak).c_str(), ratio(2.5 * f, r).c_str(),
                        dt != "fp32" ? ratio(r, r32).c_str() : "", tr, ratio(r, tr).c_str());
          }
    benchmark::Shutdown();
    return 0;
  });
}
