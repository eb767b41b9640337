// SPDX-License-Identifier: Apache-2.0
// Forward and backward throughput on Kokkos' default execution space (a GPU in
// a CUDA/HIP build of Kokkos), on the shapes issue "GPU" asks for: B = 1,
// H = 16, D = 128, N = 4096 / 8192 / 16384, full and causal, fp32 and bf16
// (16-bit storage, computed in fp32); with
// `--torch FILE` (bench/torch_sdpa.py --device cuda --heads 16 ...) PyTorch's
// scaled_dot_product_attention rates on the same GPU are printed next to
// ours, measured in the same job.
//
//   blockattn_bench_gpu [--lengths 4096,8192,16384] [--heads 16] [--dim 128]
//                       [--reps 5] [--dtypes fp32,bf16] [--torch FILE] [--portable 0|1]
//                       [--guard 0|1] [--fp32-tc off|tf32x3|tf32] [--backward 0|1]
//
// The `path` column says which implementation ran (kernel/fused.hpp): `fused`
// (cuDNN, in a build with BLOCKATTN_ENABLE_CUDNN, bf16 band masks) or `ours`
// (BlockAttn's kernels; every call with --portable 1), `tc` (BlockAttn's
// tensor-core forward, kernel/cuda/flash_forward.hpp). --guard 0 skips the
// check of V for inf / NaN that masked cuDNN calls make first
// (ForwardOptions::guard_masked_nonfinite): its cost is the difference.
// --fp32-tc runs fp32 forwards on tensor cores (ForwardOptions::
// fp32_tensor_cores, kernel/cuda/flash_forward_f32.hpp: path `tc`), its check
// of q, k, v for inf / NaN included.
//
// FLOP conventions (as bench_forward.cpp and FlashAttention's): 4 * D per
// allowed query-key pair forward, 2.5x that backward, counted on the pairs the
// mask allows (N(N+1)/2 causal). Times are the best of --reps runs, each
// fenced on the execution space instance. No host BLAS, no -march: this
// file is a device compilation unit.
#include <blockattn/blockattn.hpp>

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include "../tools/cli_args.hpp"
#include "../tools/torch_rates.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using V4f = Kokkos::View<float****, Kokkos::LayoutRight, Exec::memory_space>;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, Exec::memory_space>;

template <class F>
double best_seconds(const Exec& exec, int reps, F&& f) {
  f();  // warm-up (and first-touch of the workspace)
  exec.fence();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    exec.fence();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

namespace bench_gpu {

/// Forward and backward of every length and mask in value type T (float or
/// bf16; bf16 is stored in 16 bits and computed in fp32, LSE in fp32).
template <class T>
void run_type(const Exec& exec, const char* dtype, const std::vector<int>& lengths, int heads,
              int dim, int reps, bool portable, bool guard, blockattn::Fp32TensorCores fp32_tc,
              bool backward, const std::map<std::string, std::pair<double, std::string>>& torch) {
  blockattn::BlockPathCounts paths;
  blockattn::ForwardOptions opts;
  opts.portable_only = portable;
  opts.guard_masked_nonfinite = guard;
  opts.fp32_tensor_cores = fp32_tc;
  opts.paths = &paths;
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Exec::memory_space>;
  Kokkos::Random_XorShift64_Pool<Exec> pool(7);
  for (int n : lengths) {
    V4 q("q", 1, n, heads, dim), k("k", 1, n, heads, dim), v("v", 1, n, heads, dim);
    V4 o("o", 1, n, heads, dim), dout("dout", 1, n, heads, dim);
    V4 dq("dq", 1, n, heads, dim), dk("dk", 1, n, heads, dim), dv("dv", 1, n, heads, dim);
    V3 lse("lse", 1, heads, n);
    {
      V4f r("r", 1, n, heads, dim);
      for (auto* x : {&q, &k, &v, &dout}) {
        Kokkos::fill_random(r, pool, 1.0f);  // [0, 1)
        V4 dst = *x;
        const std::size_t count = r.size();
        float* src = r.data();
        T* out = dst.data();
        Kokkos::parallel_for(
            "bench_gpu_fill", Kokkos::RangePolicy<Exec>(exec, 0, count),
            KOKKOS_LAMBDA(std::size_t i) { out[i] = T(2.0f * src[i] - 1.0f); });
      }
      exec.fence();
    }
    for (bool causal : {false, true}) {
      const double pairs = causal ? double(n) * (n + 1) / 2 : double(n) * n;
      const double fwd_flops = 4.0 * dim * pairs * heads;
      const char* mask = causal ? "causal" : "full";
      auto fwd = [&] {
        if (causal)
          blockattn::attention_forward(exec, q, k, v, o, lse, blockattn::CausalMask{}, opts);
        else
          blockattn::attention_forward(exec, q, k, v, o, lse, blockattn::FullMask{}, opts);
      };
      auto bwd = [&] {
        if (causal)
          blockattn::attention_backward(exec, q, k, v, o, lse, dout, dq, dk, dv,
                                        blockattn::CausalMask{}, opts);
        else
          blockattn::attention_backward(exec, q, k, v, o, lse, dout, dq, dk, dv,
                                        blockattn::FullMask{}, opts);
      };
      for (int op = 0; op < (backward ? 2 : 1); ++op) {
        paths = {};
        const double s = op == 0 ? best_seconds(exec, reps, fwd) : best_seconds(exec, reps, bwd);
        const char* path = paths.fused > 0    ? (paths.portable > 0 ? "mixed" : "fused")
                           : paths.matrix > 0 ? "tc"
                                              : "ours";
        const double tf = (op == 0 ? 1.0 : 2.5) * fwd_flops / s * 1e-12;
        const std::string key = std::string(op == 0 ? "fwd" : "bwd") + "/" + std::to_string(n) +
                                "/" + std::to_string(dim) + "/" + mask + "/" + dtype;
        const auto it = torch.find(key);
        if (it != torch.end())
          std::printf("%-4s %-5s %6d %-7s %-5s %10.3f %12.2f %7.2f %-4s %8.2f\n",
                      op == 0 ? "fwd" : "bwd", dtype, n, mask, path, s * 1e3, tf, it->second.first,
                      it->second.second.c_str(), tf / it->second.first);
        else
          std::printf("%-4s %-5s %6d %-7s %-5s %10.3f %12.2f %12s %8s\n", op == 0 ? "fwd" : "bwd",
                      dtype, n, mask, path, s * 1e3, tf, "-", "-");
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace bench_gpu

/// The command line (after Kokkos::initialize took its own flags).
struct Args {
  std::vector<int> lengths{4096, 8192, 16384};
  std::vector<std::string> dtypes{"fp32", "bf16"};
  int heads = 16, dim = 128, reps = 5, portable = 0, guard = 1, backward = 1;
  std::string torch_file;
  blockattn::Fp32TensorCores fp32_tc = blockattn::Fp32TensorCores::off;
};

const char* const usage_text = R"(usage: blockattn_bench_gpu [flags]
Forward and backward throughput on Kokkos' default execution space (a GPU in a
CUDA/HIP build), B = 1, full and causal masks, next to PyTorch's SDPA rates.
  --lengths L,..   sequence lengths [4096,8192,16384]
  --heads H        [16]
  --dim D          head dim [128]
  --reps R         best of R [5]
  --dtypes T,..    fp32 and/or bf16 [fp32,bf16]
  --torch FILE     PyTorch's rates (bench/torch_sdpa.py --device cuda ...) to print next to ours
  --portable 0|1   1: our kernels only, never the fused (cuDNN) path [0]
  --guard 0|1      0: masked cuDNN calls skip their check of V for inf / NaN [1]
  --fp32-tc M      fp32 forward on tensor cores: off, tf32x3 (fp32-class) or tf32 [off]
  --backward 0|1   0: the forward alone [1]
  --help, -h       this text
Kokkos' flags (--kokkos-device-id=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports.
)";

/// Fills `args`; returns what is wrong with the command line, or "".
std::string parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a != "--lengths" && a != "--heads" && a != "--dim" && a != "--reps" && a != "--dtypes" &&
        a != "--torch" && a != "--portable" && a != "--guard" && a != "--fp32-tc" &&
        a != "--backward")
      return "unknown argument " + a + " (blockattn_bench_gpu --help lists the flags)";
    if (i + 1 == argc) return a + " needs a value";
    const std::string val = argv[i + 1];
    std::string error;
    if (a == "--lengths") error = blockattn_cli::read_int_list(a, val, args.lengths);
    if (a == "--heads") error = blockattn_cli::read_int(a, val, args.heads);
    if (a == "--dim") error = blockattn_cli::read_int(a, val, args.dim);
    if (a == "--reps") error = blockattn_cli::read_int(a, val, args.reps);
    if (a == "--portable") error = blockattn_cli::read_int(a, val, args.portable, 0, 1);
    if (a == "--guard") error = blockattn_cli::read_int(a, val, args.guard, 0, 1);
    if (a == "--backward") error = blockattn_cli::read_int(a, val, args.backward, 0, 1);
    if (!error.empty()) return error;
    if (a == "--dtypes") {
      args.dtypes = blockattn_cli::split(val);
      bool ok = !args.dtypes.empty();
      for (const auto& d : args.dtypes) ok = ok && (d == "fp32" || d == "bf16");
      if (!ok) return a + ": expected fp32 and/or bf16 (comma-separated), got '" + val + "'";
    }
    if (a == "--torch") args.torch_file = val;
    if (a == "--fp32-tc") {
      if (val == "off")
        args.fp32_tc = blockattn::Fp32TensorCores::off;
      else if (val == "tf32x3")
        args.fp32_tc = blockattn::Fp32TensorCores::tf32x3;
      else if (val == "tf32")
        args.fp32_tc = blockattn::Fp32TensorCores::tf32;
      else
        return a + ": expected off, tf32x3 or tf32, got '" + val + "'";
    }
  }
  return "";
}

int main(int argc, char** argv) {
  if (blockattn_cli::wants_help(argc, argv)) {  // before Kokkos, which has its own --help
    std::fputs(usage_text, stdout);
    return 0;
  }
  Kokkos::initialize(argc, argv);
  Args args;
  const std::string error = parse_args(argc, argv, args);
  if (!error.empty()) {
    std::fprintf(stderr, "blockattn_bench_gpu: %s\n", error.c_str());
    Kokkos::finalize();
    return 2;
  }
  const int rc = blockattn_cli::run_guarded("blockattn_bench_gpu", true, [&] {
    const auto torch = blockattn_cli::read_torch_rates(args.torch_file);
    const Exec exec;
    std::printf("BlockAttn %s on %s, B = 1, H = %d, D = %d\n", "bench_gpu", Exec::name(),
                args.heads, args.dim);
    std::printf("%-4s %-5s %6s %-7s %-5s %10s %12s %12s %8s\n", "op", "dtype", "N", "mask", "path",
                "ms", "TFLOP/s", "torch", "ours/pt");
    for (const auto& d : args.dtypes) {
      if (d == "fp32")
        bench_gpu::run_type<float>(exec, "fp32", args.lengths, args.heads, args.dim, args.reps,
                                   args.portable != 0, args.guard != 0, args.fp32_tc,
                                   args.backward != 0, torch);
      else
        bench_gpu::run_type<blockattn::bf16>(exec, "bf16", args.lengths, args.heads, args.dim,
                                             args.reps, args.portable != 0, args.guard != 0,
                                             args.fp32_tc, args.backward != 0, torch);
    }
    return 0;
  });
  Kokkos::finalize();
  return rc;
}
