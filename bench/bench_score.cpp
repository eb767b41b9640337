// SPDX-License-Identifier: Apache-2.0
// The cost of score policies and attention sinks: the single-device forward
// and backward under a causal mask with no policy, SoftCap, Alibi, a user
// policy (a per-head temperature) and sinks, timed in the same run with the
// calls interleaved (round r runs every variant once; each variant's best
// round counts), so that a shared, noisy machine moves every column alike.
// Any Kokkos (a GPU in a CUDA/HIP build).
#include <blockattn/blockattn.hpp>

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "../tools/cli_args.hpp"

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
using blockattn::index_type;

/// A user policy as examples/score_policy.cpp writes one: s (1 + step head).
struct HeadTemperature {
  float step = 0.125f;
  template <class T>
  KOKKOS_INLINE_FUNCTION T score(T s, index_type, index_type, int head) const {
    return s * (T(1) + T(step) * T(head));
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_grad(T, index_type, index_type, int head) const {
    return T(1) + T(step) * T(head);
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
void run(int n, int heads, int dim, int reps) {
  using C = blockattn::compute_t<T>;
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  const int B = 1;
  V4 q("q", B, n, heads, dim), k("k", B, n, heads, dim), v("v", B, n, heads, dim),
      o("o", B, n, heads, dim), dout("do", B, n, heads, dim), dq("dq", B, n, heads, dim),
      dk("dk", B, n, heads, dim), dv("dv", B, n, heads, dim);
  Kokkos::View<C***, Kokkos::LayoutRight, Mem> lse("lse", B, heads, n);
  Kokkos::Random_XorShift64_Pool<Exec> pool(7);
  for (V4* x : {&q, &k, &v, &dout}) {
    Kokkos::View<float****, Kokkos::LayoutRight, Mem> r("r", B, n, heads, dim);
    Kokkos::fill_random(r, pool, -1.0f, 1.0f);
    V4 dst = *x;
    Kokkos::parallel_for(
        "bench::to_t", Kokkos::RangePolicy<Exec>(0, int(r.span())),
        KOKKOS_LAMBDA(const int i) { dst.data()[i] = T(r.data()[i]); });
  }
  Kokkos::View<float*, Mem> sinks("sinks", heads), sink_grad("sink_grad", heads);
  Kokkos::deep_copy(sinks, 0.5f);
  const blockattn::CausalMask causal;
  const auto softcap = blockattn::with_score(causal, blockattn::SoftCap{30.0});
  const auto alibi = blockattn::with_score(causal, blockattn::Alibi::geometric(heads));
  const auto user = blockattn::with_score(causal, HeadTemperature{});
  blockattn::ForwardOptions plain, sunk;
  sunk.sinks = sinks;
  sunk.sink_grad = sink_grad;

  const char* names[5] = {"none", "SoftCap", "Alibi", "user", "sinks"};
  auto forward = [&](int which) {
    switch (which) {
      case 0:
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, causal, plain);
        break;
      case 1:
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, softcap, plain);
        break;
      case 2:
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, alibi, plain);
        break;
      case 3:
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, user, plain);
        break;
      default:
        blockattn::attention_forward(Exec{}, q, k, v, o, lse, causal, sunk);
        break;
    }
  };
  auto backward = [&](int which) {
    switch (which) {
      case 0:
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv, causal, plain);
        break;
      case 1:
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv, softcap, plain);
        break;
      case 2:
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv, alibi, plain);
        break;
      case 3:
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv, user, plain);
        break;
      default:
        blockattn::attention_backward(Exec{}, q, k, v, o, lse, dout, dq, dk, dv, causal, sunk);
        break;
    }
  };
  std::vector<double> fwd(5, 1e30), bwd(5, 1e30);
  for (int w = 0; w < 5; ++w) {  // warm up every variant
    forward(w);
    backward(w);
  }
  Kokkos::fence();
  for (int r = 0; r < reps; ++r)
    for (int w = 0; w < 5; ++w) {
      auto t0 = std::chrono::steady_clock::now();
      forward(w);
      Kokkos::fence();
      fwd[std::size_t(w)] = std::min(fwd[std::size_t(w)], seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      backward(w);
      Kokkos::fence();
      bwd[std::size_t(w)] = std::min(bwd[std::size_t(w)], seconds_since(t0));
    }
  // Causal: half of the N x N pairs; forward 4 N^2 D / 2 FLOPs per head,
  // backward 2.5x that.
  const double flops = 2.0 * double(B) * heads * double(n) * n * dim;
  for (int w = 0; w < 5; ++w)
    std::printf("%-5s %6d %3d %4d %-8s %9.2f %7.3f %9.2f %7.3f\n", blockattn::value_type_name<T>(),
                n, heads, dim, names[w], flops / fwd[std::size_t(w)] * 1e-9,
                fwd[0] / fwd[std::size_t(w)], 2.5 * flops / bwd[std::size_t(w)] * 1e-9,
                bwd[0] / bwd[std::size_t(w)]);
}

}  // namespace

const char* const usage_text = R"(usage: blockattn_bench_score [flags]
The cost of score policies and sinks on one device: forward and backward,
causal mask, B = 1, with no policy, SoftCap, Alibi, a user policy and sinks,
interleaved in one run (best of --reps rounds each). Columns: GFLOP/s of the
forward and the backward (causal FLOPs) and each rate as a fraction of the
no-policy rate of the same run (1.000 = free).
  --n N1,N2     sequence lengths [2048,4096]
  --heads H     query (= K/V) heads [8]
  --dim D       head dim [128]
  --dtype T     fp32, bf16 or fp32,bf16 [fp32,bf16]
  --reps R      rounds [3]
  --help, -h    this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports.
)";

int main(int argc, char** argv) {
  return blockattn_cli::kokkos_main(argc, argv, "blockattn_bench_score", usage_text, true, [&] {
    std::vector<int> lengths{2048, 4096};
    int heads = 8, dim = 128, reps = 3;
    std::string dtypes = "fp32,bf16", error;
    for (int i = 1; i < argc && error.empty(); ++i) {
      const std::string f = argv[i];
      if (f != "--n" && f != "--heads" && f != "--dim" && f != "--dtype" && f != "--reps")
        error = "unknown argument " + f + " (blockattn_bench_score --help lists the flags)";
      else if (i + 1 >= argc)
        error = f + " needs a value";
      else if (f == "--n")
        error = blockattn_cli::read_int_list(f, argv[++i], lengths, 1, 1 << 20);
      else if (f == "--heads")
        error = blockattn_cli::read_int(f, argv[++i], heads, 1, blockattn::Alibi::max_heads);
      else if (f == "--dim")
        error = blockattn_cli::read_int(f, argv[++i], dim, 1, blockattn::max_head_dim);
      else if (f == "--reps")
        error = blockattn_cli::read_int(f, argv[++i], reps, 1, 1000);
      else {
        dtypes = argv[++i];
        for (const std::string& t : blockattn_cli::split(dtypes))
          if (t != "fp32" && t != "bf16") error = "--dtype " + t + ": expected fp32 or bf16";
      }
    }
    if (!error.empty()) {
      std::fprintf(stderr, "blockattn_bench_score: %s\n", error.c_str());
      return 2;
    }
    std::printf("Score policies and sinks, causal, B = 1, %d threads (%s)\n", Exec{}.concurrency(),
                Exec::name());
    std::printf("%-5s %6s %3s %4s %-8s %9s %7s %9s %7s\n", "type", "N", "H", "D", "policy",
                "fwd GF/s", "x none", "bwd GF/s", "x none");
    for (const std::string& t : blockattn_cli::split(dtypes))
      for (const int n : lengths) {
        if (t == "fp32")
          run<float>(n, heads, dim, reps);
        else
          run<blockattn::bf16>(n, heads, dim, reps);
      }
    return 0;
  });
}
