// SPDX-License-Identifier: Apache-2.0
// A KV ring's steps next to one call (run under mpiexec; any Kokkos, built for
// the GPU by bench/pack_gpu_bundle.sh's builds; not in `all`).
//
//   mpiexec -n P blockattn_bench_steps [--n 16384] [--heads 16] [--dim 128]
//                                      [--reps 5] [--dtype bf16] [--portable 0|1]
//                                      [--pass forward|backward] [--schedule ring|burst]
//
// Zigzag partition, causal mask, RingSchedule, B = 1, random inputs in
// [-1, 1). Rank 0 first times attention_forward on the whole sequence (one
// call, one device: the time the ring's P ranks share); then every rank runs
// the ring, best of --reps calls (the call's time is the slowest rank's). For
// the best call it prints, per step, the slowest rank's wall time and busy
// (compute) time, which path computed each rank's pair (cuDNN's fused
// attention or BlockAttn's kernels) and how many band pieces went to cuDNN.
// Ranks sharing one GPU (mpiexec -n 2 on one device) run their pairs
// side by side, so the ring's call time is comparable to the one-call time.
// --pass backward times the backward instead (one attention_backward; the
// ring's backward after one forward), at 2.5x the forward's FLOPs;
// --schedule burst takes BurstSchedule (the same KV ring forward, a Q ring
// backward: the pairs of travelled queries).
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include "../tools/cli_args.hpp"
#include "mpi_main.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Comm = blockattn::MpiCommunicator<>;
using Part = blockattn::ZigzagPartition;
using Mask = blockattn::CausalMask;
using V4f = Kokkos::View<float****, Kokkos::LayoutRight, Exec::memory_space>;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, Exec::memory_space>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* path_name(blockattn::BlockPath p) {
  switch (p) {
    case blockattn::BlockPath::fused:
      return "cudnn";
    case blockattn::BlockPath::portable:
      return "ours";
    case blockattn::BlockPath::matrix:
      return "tensor";
    default:
      return "none";
  }
}

}  // namespace

// A named namespace: nvcc's extended lambdas may not sit in a function of an
// unnamed one.
namespace bench_steps {

struct Args {
  int n = 16384, heads = 16, dim = 128, reps = 5, portable = 0;
  std::string dtype = "bf16", pass = "forward", schedule = "ring";
};

/// q, k, v of `len` tokens, uniform in [-1, 1) (seeded per rank).
template <class V4>
void fill(const Exec& exec, const std::vector<V4*>& views, unsigned seed) {
  Kokkos::Random_XorShift64_Pool<Exec> pool(seed);
  for (V4* x : views) {
    V4f r("r", x->extent(0), x->extent(1), x->extent(2), x->extent(3));
    Kokkos::fill_random(r, pool, 1.0f);
    using T = typename V4::value_type;
    T* out = x->data();
    const float* src = r.data();
    Kokkos::parallel_for(
        "bench_steps_fill", Kokkos::RangePolicy<Exec>(exec, 0, r.size()),
        KOKKOS_LAMBDA(std::size_t i) { out[i] = T(2.0f * src[i] - 1.0f); });
    exec.fence();
  }
}

template <class T, class Schedule>
void run(Comm& comm, const Args& a) {
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Exec::memory_space>;
  const int P = comm.size(), rank = comm.rank();
  const Exec exec;
  const double pairs = double(a.n) * (a.n + 1) / 2;  // causal
  const bool bwd = a.pass == "backward";
  const double flops = (bwd ? 2.5 : 1.0) * 4.0 * a.dim * pairs * a.heads;

  // One call on one device (rank 0), the whole sequence.
  double one_call = 0.0;
  blockattn::BlockPathCounts one_paths;
  if (rank == 0) {
    V4 q("q", 1, a.n, a.heads, a.dim), k("k", 1, a.n, a.heads, a.dim),
        v("v", 1, a.n, a.heads, a.dim), o("o", 1, a.n, a.heads, a.dim);
    V3 lse("lse", 1, a.heads, a.n);
    fill(exec, std::vector<V4*>{&q, &k, &v}, 11);
    blockattn::ForwardOptions fo;
    fo.portable_only = a.portable != 0;
    fo.paths = &one_paths;
    blockattn::attention_forward(exec, q, k, v, o, lse, Mask{}, fo);  // warm-up
    V4 dout, dq, dk, dv;
    if (bwd) {
      dout = V4("do", 1, a.n, a.heads, a.dim);
      dq = V4("dq", 1, a.n, a.heads, a.dim);
      dk = V4("dk", 1, a.n, a.heads, a.dim);
      dv = V4("dv", 1, a.n, a.heads, a.dim);
      fill(exec, std::vector<V4*>{&dout}, 12);
      blockattn::attention_backward(exec, q, k, v, o, lse, dout, dq, dk, dv, Mask{}, fo);
    }
    exec.fence();
    one_call = 1e30;
    for (int r = 0; r < a.reps; ++r) {
      one_paths = {};
      const double t0 = now();
      if (bwd)
        blockattn::attention_backward(exec, q, k, v, o, lse, dout, dq, dk, dv, Mask{}, fo);
      else
        blockattn::attention_forward(exec, q, k, v, o, lse, Mask{}, fo);
      exec.fence();
      one_call = std::min(one_call, now() - t0);
    }
  }
  comm.barrier();

  // The ring: this rank's zigzag part.
  const auto len = blockattn::local_length<Part>(a.n, P, rank);
  V4 q("q", 1, len, a.heads, a.dim), k("k", 1, len, a.heads, a.dim), v("v", 1, len, a.heads, a.dim),
      o("o", 1, len, a.heads, a.dim);
  V3 lse("lse", 1, a.heads, len);
  fill(exec, std::vector<V4*>{&q, &k, &v}, 100 + unsigned(rank));
  blockattn::DistributedAttention<Part, Mask, Schedule, Comm> attn(comm);
  blockattn::DistributedOptions opts;
  opts.portable_only = a.portable != 0;
  attn.forward(q, k, v, o, lse, opts);  // warm-up (cuDNN graphs, workspace)
  V4 dout, dq, dk, dv;
  if (bwd) {
    dout = V4("do", 1, len, a.heads, a.dim);
    dq = V4("dq", 1, len, a.heads, a.dim);
    dk = V4("dk", 1, len, a.heads, a.dim);
    dv = V4("dv", 1, len, a.heads, a.dim);
    fill(exec, std::vector<V4*>{&dout}, 200 + unsigned(rank));
    attn.backward(q, k, v, o, lse, dout, dq, dk, dv, opts);  // warm-up
  }
  exec.fence();
  double best = 1e30;
  blockattn::RunStats best_stats;
  for (int r = 0; r < a.reps; ++r) {
    comm.barrier();
    const double t0 = now();
    blockattn::RunStats s = bwd ? attn.backward(q, k, v, o, lse, dout, dq, dk, dv, opts)
                                : attn.forward(q, k, v, o, lse, opts);
    exec.fence();
    const double t = comm.allreduce(now() - t0, blockattn::ReduceOp::max);
    if (t < best) {
      best = t;
      best_stats = std::move(s);
    }
  }
  const int steps = int(best_stats.steps.size());
  if (rank == 0) {
    std::printf("%s %s on %s, P = %d, zigzag, causal, %s, N = %d, H = %d, D = %d%s\n",
                bwd && a.schedule == "burst" ? "Q ring" : "KV ring", a.pass.c_str(), Exec::name(),
                P, blockattn::value_type_name<T>(), a.n, a.heads, a.dim,
                a.portable ? ", BlockAttn's kernels only" : "");
    std::printf("%5s %12s %12s  %s\n", "step", "wall[ms]", "busy[ms]",
                "path of each rank's pair: cudnn (band pieces), tensor (cores), ours");
  }
  for (int i = 0; i < steps; ++i) {
    const auto& st = best_stats.steps[std::size_t(i)];
    const double wall = comm.allreduce(st.seconds, blockattn::ReduceOp::max);
    const double busy = comm.allreduce(st.compute_seconds, blockattn::ReduceOp::max);
    // Every rank's path and pieces, gathered through sums of one-hot slots.
    std::vector<double> mine(std::size_t(2 * P), 0.0), all(std::size_t(2 * P), 0.0);
    mine[std::size_t(rank)] = double(int(st.path));
    mine[std::size_t(P + rank)] = double(st.fused_pieces);
    for (int j = 0; j < 2 * P; ++j)
      all[std::size_t(j)] = comm.allreduce(mine[std::size_t(j)], blockattn::ReduceOp::sum);
    if (rank == 0) {
      std::printf("%5d %12.3f %12.3f  ", i, wall * 1e3, busy * 1e3);
      for (int r = 0; r < P; ++r)
        std::printf("%s%s(%d)", r ? " " : "",
                    path_name(blockattn::BlockPath(int(all[std::size_t(r)]))),
                    int(all[std::size_t(P + r)]));
      std::printf("\n");
    }
  }
  if (rank == 0) {
    std::printf(
        "one %s call (rank 0, whole sequence): %.3f ms, %.1f TFLOP/s, paths: %lld ours, "
        "%lld cuDNN (%lld pieces)\n",
        a.pass.c_str(), one_call * 1e3, flops / one_call * 1e-12, (long long)one_paths.portable,
        (long long)one_paths.fused, (long long)one_paths.fused_pieces);
    std::printf("ring call (slowest rank): %.3f ms, %.1f TFLOP/s; ring / one call = %.2f\n",
                best * 1e3, flops / best * 1e-12, best / one_call);
  }
}

}  // namespace bench_steps

namespace {

const char* const usage_text = R"(usage: mpiexec -n P blockattn_bench_steps [flags]
A ring's per-step times next to one call: zigzag partition, causal mask,
B = 1, random inputs. Rank 0 times attention_forward on the whole sequence,
then all ranks time the ring (best of R); per step the slowest rank's wall and
busy time and the path (cuDNN or BlockAttn's kernels) of every rank's pair.
  --n N          global sequence length (a multiple of 2P) [16384]
  --heads H      [16]
  --dim D        head dim [128]
  --reps R       best of R [5]
  --dtype T      bf16|fp16|fp32 [bf16]
  --portable 0|1 1: BlockAttn's kernels only, never cuDNN [0]
  --pass P       forward|backward (the backward after one forward) [forward]
  --schedule S   ring|burst (RingSchedule; BurstSchedule: a Q ring backward) [ring]
  --help, -h     this text
Kokkos' flags (--kokkos-device-id=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports (printed by rank 0).
)";

}  // namespace

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_steps", usage_text, [&](const int rank) {
        Comm comm(MPI_COMM_WORLD);
        bench_steps::Args a;
        std::string error;
        for (int i = 1; i < argc && error.empty(); ++i) {
          const std::string f = argv[i];
          if (f != "--n" && f != "--heads" && f != "--dim" && f != "--reps" && f != "--dtype" &&
              f != "--portable" && f != "--pass" && f != "--schedule")
            error = "unknown argument " + f + " (blockattn_bench_steps --help lists the flags)";
          else if (i + 1 >= argc)
            error = f + " needs a value";
          else if (f == "--n")
            error = blockattn_cli::read_int(f, argv[++i], a.n);
          else if (f == "--heads")
            error = blockattn_cli::read_int(f, argv[++i], a.heads);
          else if (f == "--dim")
            error = blockattn_cli::read_int(f, argv[++i], a.dim);
          else if (f == "--reps")
            error = blockattn_cli::read_int(f, argv[++i], a.reps);
          else if (f == "--portable")
            error = blockattn_cli::read_int(f, argv[++i], a.portable, 0, 1);
          else if (f == "--schedule") {
            a.schedule = argv[++i];
            if (a.schedule != "ring" && a.schedule != "burst")
              error = "--schedule: expected ring or burst, got '" + a.schedule + "'";
          } else if (f == "--pass") {
            a.pass = argv[++i];
            if (a.pass != "forward" && a.pass != "backward")
              error = "--pass: expected forward or backward, got '" + a.pass + "'";
          } else {
            a.dtype = argv[++i];
            if (a.dtype != "fp32" && a.dtype != "bf16" && a.dtype != "fp16")
              error = "--dtype: expected fp32, bf16 or fp16, got '" + a.dtype + "'";
          }
        }
        if (error.empty() && a.n % (2 * comm.size()) != 0)
          error = "--n: expected a multiple of 2P = " + std::to_string(2 * comm.size()) + ", got " +
                  std::to_string(a.n);
        if (!error.empty()) {  // every rank read the same command line
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_steps: %s\n", error.c_str());
          return 2;
        }
        const auto with = [&](auto schedule) {
          using Sched = decltype(schedule);
          if (a.dtype == "bf16")
            bench_steps::run<blockattn::bf16, Sched>(comm, a);
          else if (a.dtype == "fp16")
            bench_steps::run<blockattn::fp16, Sched>(comm, a);
          else
            bench_steps::run<float, Sched>(comm, a);
        };
        if (a.schedule == "burst")
          with(blockattn::BurstSchedule{});
        else
          with(blockattn::RingSchedule{});
        return 0;
      });
}
