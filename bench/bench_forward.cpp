// SPDX-License-Identifier: Apache-2.0
// Forward and backward throughput of the tile kernels vs an fp32 GEMM of the
// same size and vs PyTorch's CPU scaled_dot_product_attention, in one run.
//
// GFLOP/s counts 4 * D per *allowed* query-key pair (masked pairs are not
// work). The reference GEMM is cblas_sgemm of the Q K^T shape (N x N x D) and
// a 4096^3 sgemm (the machine's GEMM peak), with as many BLAS threads as
// Kokkos has. After Google Benchmark's table the binary prints, per case,
// attention GFLOP/s / GEMM GFLOP/s and causal / full, and with --torch=FILE
// (written by bench/torch_sdpa.py just before, same thread count) PyTorch's
// rate on the same case and our ratio to it.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <blockattn/blockattn.hpp>
#ifdef BLOCKATTN_BENCH_HAVE_KOKKOS_KERNELS
#include <blockattn/kokkos_kernels_gemm.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
constexpr bool host = blockattn::impl::is_host_space_v<Exec>;

enum MaskId { full = 0, causal = 1 };

template <class Shape>
void bm_attention(benchmark::State& state) {
  const int n = int(state.range(0)), d = int(state.range(1));
  const MaskId mask = MaskId(state.range(2));
  Kokkos::View<float****> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d),
      o("o", 1, n, 1, d);
  Kokkos::View<float***> lse("lse", 1, 1, n);
  auto fill = [](auto view, unsigned seed) {
    auto h = Kokkos::create_mirror_view(view);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
    Kokkos::deep_copy(view, h);
  };
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  auto run = [&] {
    if (mask == causal)
      blockattn::impl::forward<Shape>("bench", Exec{}, q, k, v, o, lse, blockattn::CausalMask{},
                                      blockattn::OffsetPositions{}, blockattn::OffsetPositions{},
                                      std::nan(""));
    else
      blockattn::impl::forward<Shape>("bench", Exec{}, q, k, v, o, lse, blockattn::FullMask{},
                                      blockattn::OffsetPositions{}, blockattn::OffsetPositions{},
                                      std::nan(""));
    Kokkos::fence();
  };
  run();  // warm-up
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const blockattn::TileSizes ts = blockattn::forward_tile_sizes<float, Exec, Shape>(d);
  const blockattn::TileCounts tiles =
      mask == causal ? blockattn::count_tiles(blockattn::CausalMask{}, n, n, ts.block_q, ts.block_k)
                     : blockattn::count_tiles(blockattn::FullMask{}, n, n, ts.block_q, ts.block_k);
  state.counters["GFLOP/s"] =
      benchmark::Counter(blockattn::forward_flops(tiles.allowed_pairs, d) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = Exec().concurrency();
  state.SetLabel(std::string(mask == causal ? "causal" : "full") + " " + Shape::tile_gemm::name());
}

/// Backward: dQ, dK, dV from the saved O and LSE. GFLOP/s counts 2.5x the
/// forward's FLOPs on allowed pairs (FlashAttention's convention: 5 of the
/// forward's 2 tile products), although our two-kernel backward computes 7.
void bm_backward(benchmark::State& state) {
  const int n = int(state.range(0)), d = int(state.range(1));
  const MaskId mask = MaskId(state.range(2));
  Kokkos::View<float****> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d),
      o("o", 1, n, 1, d), dout("do", 1, n, 1, d), dq("dq", 1, n, 1, d), dk("dk", 1, n, 1, d),
      dv("dv", 1, n, 1, d);
  Kokkos::View<float***> lse("lse", 1, 1, n);
  Kokkos::deep_copy(q, 0.01f);
  Kokkos::deep_copy(k, 0.02f);
  Kokkos::deep_copy(v, 1.0f);
  Kokkos::deep_copy(dout, 0.5f);
  auto run = [&](bool backward) {
    if (mask == causal) {
      if (backward)
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv,
                                      blockattn::CausalMask{});
      else
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, blockattn::CausalMask{});
    } else {
      if (backward)
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv);
      else
        blockattn::attention_forward(Exec{}, q, k, v, o, lse);
    }
    Kokkos::fence();
  };
  run(false);
  run(true);
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    run(true);
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const std::int64_t pairs = mask == causal ? std::int64_t(n) * (n + 1) / 2 : std::int64_t(n) * n;
  state.counters["GFLOP/s"] = benchmark::Counter(2.5 * blockattn::forward_flops(pairs, d) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = Exec().concurrency();
  state.SetLabel(mask == causal ? "causal backward" : "full backward");
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
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * nn * kk * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = Exec().concurrency();
}

/// Keeps every run's GFLOP/s to print the ratios at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> rate;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      auto it = r.counters.find("GFLOP/s");
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

std::string attn_name(const char* variant, int n, int d, int mask) {
  return std::string("attention/") + variant + "/N:" + std::to_string(n) +
         "/D:" + std::to_string(d) + (mask == causal ? "/causal" : "/full");
}

std::string bwd_name(int n, int d, int mask) {
  return "backward/N:" + std::to_string(n) + "/D:" + std::to_string(d) +
         (mask == causal ? "/causal" : "/full");
}

std::string gemm_name(int n, int d) {
  return "sgemm/M:" + std::to_string(n) + "/N:" + std::to_string(n) + "/K:" + std::to_string(d);
}

void register_all(bool quick) {
  for (int d : dims)
    for (int n : lengths) {
      if (quick && n > 4096) continue;
      for (int mask : {full, causal}) {
        benchmark::RegisterBenchmark(attn_name("register", n, d, mask).c_str(),
                                     bm_attention<RegisterShape>)
            ->Args({n, d, mask})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.3);
#ifdef BLOCKATTN_BENCH_HAVE_KOKKOS_KERNELS
        if (n <= 1024)  // the slower variant: one size is enough to compare
          benchmark::RegisterBenchmark(attn_name("kokkos_batched", n, d, mask).c_str(),
                                       bm_attention<BatchedShape>)
              ->Args({n, d, mask})
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(0.3);
#endif
      }
      for (int mask : {full, causal})
        benchmark::RegisterBenchmark(bwd_name(n, d, mask).c_str(), bm_backward)
            ->Args({n, d, mask})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.3);
      benchmark::RegisterBenchmark(gemm_name(n, d).c_str(), bm_sgemm)
          ->Args({n, n, d})
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.3);
    }
  benchmark::RegisterBenchmark("sgemm/4096^3", bm_sgemm)
      ->Args({4096, 4096, 4096})
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->MinTime(0.5);
}

/// PyTorch's rates from bench/torch_sdpa.py: "<fwd|bwd> N D mask dtype GFLOP/s" per line.
std::map<std::string, double> read_torch(const std::string& path) {
  std::map<std::string, double> r;
  std::ifstream in(path);
  std::string op, mask, dtype;
  int n = 0, d = 0;
  double g = 0;
  while (in >> op >> n >> d >> mask >> dtype >> g)
    if (dtype == "fp32") r[op + "/" + std::to_string(n) + "/" + std::to_string(d) + "/" + mask] = g;
  return r;
}

std::string torch_key(const char* op, int n, int d, int mask) {
  return std::string(op) + "/" + std::to_string(n) + "/" + std::to_string(d) +
         (mask == causal ? "/causal" : "/full");
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::initialize(argc, argv);
  {
    bool quick = false;
    std::map<std::string, double> torch;
    std::vector<char*> args;
    for (int i = 0; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick")
        quick = true;
      else if (a.rfind("--torch=", 0) == 0)
        torch = read_torch(a.substr(8));
      else
        args.push_back(argv[i]);
    }
    int bargc = int(args.size());
    benchmark::Initialize(&bargc, args.data());
    register_all(quick);
    RatioReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);

    const int threads = Exec().concurrency();
    const double peak = reporter.rate["sgemm/4096^3"];
    std::printf(
        "\nRatios measured in this run (%s, %d thread%s; host ISA %s; sgemm 4096^3 = %.1f "
        "GFLOP/s; PyTorch: %s)\n",
        Exec::name(), threads, threads == 1 ? "" : "s", blockattn::host_isa_name(), peak,
        torch.empty() ? "not run" : "same run, same threads");
    std::printf("%-16s %5s %5s %7s %10s %14s %14s %14s %10s %9s\n", "variant", "N", "D", "mask",
                "GFLOP/s", "/ sgemm(NxNxD)", "/ sgemm 4096^3", "causal / full", "torch", "/ torch");
    for (const char* variant : {"register", "kokkos_batched"})
      for (int d : dims)
        for (int n : lengths)
          for (int mask : {full, causal}) {
            auto it = reporter.rate.find(attn_name(variant, n, d, mask));
            if (it == reporter.rate.end()) continue;
            const double g = reporter.rate[gemm_name(n, d)];
            const double f = reporter.rate[attn_name(variant, n, d, full)];
            const auto t = torch.find(torch_key("fwd", n, d, mask));
            const double tr = t == torch.end() ? 0.0 : t->second;
            std::printf("%-16s %5d %5d %7s %10.1f %14.2f %14.2f %14s %10.1f %9.2f\n", variant, n, d,
                        mask == causal ? "causal" : "full", it->second, it->second / g,
                        peak > 0 ? it->second / peak : 0.0,
                        mask == causal ? std::to_string(it->second / f).substr(0, 4).c_str() : "",
                        tr, tr > 0 ? it->second / tr : 0.0);
          }
    std::printf("\nBackward (dQ, dK, dV; GFLOP/s = 2.5 x forward FLOPs on allowed pairs)\n");
    std::printf("%5s %5s %7s %10s %14s %14s %12s %10s %9s\n", "N", "D", "mask", "GFLOP/s",
                "/ sgemm(NxNxD)", "/ sgemm 4096^3", "bwd/fwd time", "torch", "/ torch");
    for (int d : dims)
      for (int n : lengths)
        for (int mask : {full, causal}) {
          auto it = reporter.rate.find(bwd_name(n, d, mask));
          if (it == reporter.rate.end()) continue;
          const double g = reporter.rate[gemm_name(n, d)];
          const double f = reporter.rate[attn_name("register", n, d, mask)];
          const auto t = torch.find(torch_key("bwd", n, d, mask));
          const double tr = t == torch.end() ? 0.0 : t->second;
          std::printf("%5d %5d %7s %10.1f %14.2f %14.2f %12.2f %10.1f %9.2f\n", n, d,
                      mask == causal ? "causal" : "full", it->second, it->second / g,
                      peak > 0 ? it->second / peak : 0.0, f > 0 ? 2.5 * f / it->second : 0.0, tr,
                      tr > 0 ? it->second / tr : 0.0);
        }
    benchmark::Shutdown();
  }
  Kokkos::finalize();
  return 0;
}
