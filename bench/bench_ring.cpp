// SPDX-License-Identifier: Apache-2.0
// KV-ring benchmarks (run under mpiexec; see bench/run_ring.sh).
//
// overlap (default): for local block sizes c (tokens per rank), full attention,
//   times the ring (communication posted before each step's compute, completed
//   after it) against the same steps with no communication (each rank computes
//   the same tiles on its local block), interleaved, best of R each. Also
//   measures F (attained FLOP/s of one step) and B (bytes/s of the same
//   exchange without compute) and prints the condition of Ring Attention (arXiv:2310.01889)
//   (compute of a step >= transfer of a block: c >= F * bytes_per_token / (4 d)).
// --memory: per-rank memory at a fixed block size: what the schedule allocates
//   (workspace), the local Q, K, V, O, LSE, and the process' peak RSS.
// --bytes: the backward rings' bytes per step and times for a few head shapes.
// --dtype fp32|bf16|fp16 [fp32]: the value type of Q, K, V, O (bf16 / fp16:
//   K/V and Q travel in 16 bits; LSE, partial results and sums in fp32).
#include <sys/resource.h>
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "../tools/cli_args.hpp"
#include "mpi_main.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

template <class T>
using V4 = Kokkos::View<T****>;
template <class T>
using V3 = Kokkos::View<blockattn::compute_t<T>***>;
using Comm = blockattn::MpiCommunicator<>;
using Attn = blockattn::DistributedAttention<blockattn::ContiguousPartition, blockattn::FullMask,
                                             blockattn::RingSchedule, Comm>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class T>
struct Local {
  V4<T> q, k, v, o;
  V3<T> lse;
  Local(int c, int h, int d)
      : q("q", 1, c, h, d),
        k("k", 1, c, h, d),
        v("v", 1, c, h, d),
        o("o", 1, c, h, d),
        lse("lse", 1, h, c) {
    Kokkos::deep_copy(q, T(0.01f));
    Kokkos::deep_copy(k, T(0.02f));
    Kokkos::deep_copy(v, T(1.0f));
  }
};

template <class T>
void overlap(Comm& comm, int reps) {
  const int d = 128, h = 1;
  const int P = comm.size();
  if (comm.rank() == 0) {
    std::printf("KV ring overlap, P = %d, full mask, %s, D = %d, %d thread(s) per rank\n", P,
                blockattn::value_type_name<T>(), d, Kokkos::DefaultExecutionSpace().concurrency());
    std::printf("%8s %12s %12s %10s %12s %12s %10s\n", "c", "ring[ms]", "compute[ms]", "ring/comp",
                "F[GFLOP/s]", "B[GB/s]", "c_min=F/B'");
  }
  for (int c : {256, 512, 1024, 2048, 4096}) {
    Local<T> x(c, h, d);
    Attn attn(comm);
    blockattn::DistributedOptions ring, compute;
    compute.communicate = false;
    double best_ring = 1e30, best_comp = 1e30;
    attn.forward(x.q, x.k, x.v, x.o, x.lse, ring);  // warm-up
    for (int r = 0; r < reps; ++r) {
      for (int mode = 0; mode < 2; ++mode) {
        comm.barrier();
        const double t0 = now();
        attn.forward(x.q, x.k, x.v, x.o, x.lse, mode == 0 ? ring : compute);
        const double t = comm.allreduce(now() - t0, blockattn::ReduceOp::max);
        (mode == 0 ? best_ring : best_comp) = std::min(mode == 0 ? best_ring : best_comp, t);
      }
    }
    // B: the same exchange of one packed block with nobody computing.
    const std::int64_t bytes = attn.forward(x.q, x.k, x.v, x.o, x.lse, ring).steps[0].bytes_sent;
    Kokkos::View<char*> sbuf("s", bytes), rbuf("r", bytes);
    double best_xfer = 1e30;
    for (int r = 0; r < reps; ++r) {
      comm.barrier();
      const double t0 = now();
      auto rq = comm.irecv(rbuf, blockattn::ring_prev(comm), 99);
      auto sq = comm.isend(sbuf, blockattn::ring_next(comm), 99);
      comm.wait(rq);
      comm.wait(sq);
      best_xfer = std::min(best_xfer, comm.allreduce(now() - t0, blockattn::ReduceOp::max));
    }
    const double F = 4.0 * double(c) * c * d * h / (best_comp / P);  // FLOP/s of one step
    const double B = double(bytes) / best_xfer;                      // bytes/s of one block
    // Compute of a step (4 c^2 d / F) >= transfer of a block (bytes_per_token * c / B):
    const double c_min = F * (double(bytes) / c) / (4.0 * d * h) / B;
    if (comm.rank() == 0)
      std::printf("%8d %12.3f %12.3f %10.3f %12.1f %12.2f %10.0f\n", c, best_ring * 1e3,
                  best_comp * 1e3, best_ring / best_comp, F * 1e-9, B * 1e-9, c_min);
  }
}

template <class T>
void memory(Comm& comm, int c) {
  const int d = 128, h = 1;
  Local<T> x(c, h, d);
  Attn attn(comm);
  const auto stats = attn.forward(x.q, x.k, x.v, x.o, x.lse);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const double block = double(c) * d * h * sizeof(T);  // one (c x d) block
  const double inputs =
      4 * block + double(x.lse.span()) * sizeof(typename decltype(x.lse)::value_type);
  const double peak_rss = comm.allreduce(double(ru.ru_maxrss) * 1024.0, blockattn::ReduceOp::max);
  const double ws = comm.allreduce(double(stats.workspace_bytes), blockattn::ReduceOp::max);
  if (comm.rank() == 0)
    std::printf(
        "memory: %s P=%d N=%lld c=%d D=%d | per rank: workspace %.2f MiB (%.2f blocks), "
        "q/k/v/o/lse %.2f MiB (%.2f blocks), peak RSS %.1f MiB\n",
        blockattn::value_type_name<T>(), comm.size(), (long long)c * comm.size(), c, d,
        ws / 1048576.0, ws / block, inputs / 1048576.0, inputs / block, peak_rss / 1048576.0);
}

/// Backward bytes per step of the two rings (max over steps and ranks, per
/// rank) for a few head shapes, and their backward times on this machine.
template <class T, class Schedule>
std::pair<std::int64_t, double> backward_run(Comm& comm, int c, int h, int hkv, int d, int reps) {
  V4<T> q("q", 1, c, h, d), k("k", 1, c, hkv, d), o("o", 1, c, h, d), dq("dq", 1, c, h, d),
      dk("dk", 1, c, hkv, d), dv("dv", 1, c, hkv, d);
  V3<T> lse("lse", 1, h, c);
  Kokkos::deep_copy(q, T(0.01f));
  Kokkos::deep_copy(k, T(0.02f));
  blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask, Schedule,
                                  Comm>
      attn(comm);
  attn.forward(q, k, k, o, lse);
  std::int64_t per_step = 0;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    const double t0 = now();
    const auto stats = attn.backward(q, k, k, o, lse, o, dq, dk, dv);
    best = std::min(best, comm.allreduce(now() - t0, blockattn::ReduceOp::max));
    for (const auto& s : stats.steps) per_step = std::max(per_step, s.bytes_sent);
  }
  return {comm.allreduce(per_step, blockattn::ReduceOp::max), best};
}

template <class T>
void bytes(Comm& comm, int reps) {
  const int c = 1024;
  if (comm.rank() == 0) {
    std::printf(
        "Backward rings, P = %d, striped causal, %s, %d tokens per rank: bytes per step "
        "(per rank) and time\n",
        comm.size(), blockattn::value_type_name<T>(), c);
    std::printf("%4s %4s %4s %14s %14s %10s %12s %12s\n", "H", "Hkv", "D", "KV ring [B]",
                "Q ring [B]", "KV/Q", "KV ring[ms]", "Q ring[ms]");
  }
  const int shapes[][3] = {{8, 8, 64}, {8, 2, 64}, {8, 1, 64}, {4, 4, 128}, {4, 1, 128}};
  for (const auto& s : shapes) {
    const auto kv = backward_run<T, blockattn::RingSchedule>(comm, c, s[0], s[1], s[2], reps);
    const auto qr = backward_run<T, blockattn::BurstSchedule>(comm, c, s[0], s[1], s[2], reps);
    if (comm.rank() == 0)
      std::printf("%4d %4d %4d %14lld %14lld %10.2f %12.2f %12.2f\n", s[0], s[1], s[2],
                  (long long)kv.first, (long long)qr.first, double(kv.first) / double(qr.first),
                  kv.second * 1e3, qr.second * 1e3);
  }
}

}  // namespace

const char* const usage_text = R"(usage: mpiexec -n P blockattn_bench_ring [flags]
KV-ring benchmarks. Default (overlap): for local blocks of c tokens, full
attention, the ring against the same steps without communication, best of R;
F (FLOP/s of a step), B (bytes/s of the exchange) and Ring Attention's
condition for hiding the transfers.
  --memory      instead: per-rank memory at block size --c (workspace, inputs, peak RSS)
  --bytes       instead: the backward rings' bytes per step and times for a few head shapes
  --c c         tokens per rank for --memory [4096]
  --reps R      best of R [5]
  --dtype T     fp32|bf16|fp16 [fp32] (bf16 / fp16: K/V and Q travel in 16 bits)
  --help, -h    this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports (printed by rank 0).
)";

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_ring", usage_text, [&](const int rank) {
        Comm comm(MPI_COMM_WORLD);
        bool mem = false, byt = false;
        int c = 4096, reps = 5;
        std::string dtype = "fp32", error;
        for (int i = 1; i < argc && error.empty(); ++i) {
          const std::string f = argv[i];
          const bool has_value = i + 1 < argc;
          if (f == "--memory")
            mem = true;
          else if (f == "--bytes")
            byt = true;
          else if (f != "--c" && f != "--reps" && f != "--dtype")
            error = "unknown argument " + f + " (blockattn_bench_ring --help lists the flags)";
          else if (!has_value)
            error = f + " needs a value";
          else if (f == "--c")
            error = blockattn_cli::read_int(f, argv[++i], c);
          else if (f == "--reps")
            error = blockattn_cli::read_int(f, argv[++i], reps);
          else {
            dtype = argv[++i];
            if (dtype != "fp32" && dtype != "bf16" && dtype != "fp16")
              error = "--dtype: expected fp32, bf16 or fp16, got '" + dtype + "'";
          }
        }
        const auto run = [&](auto value) {
          using T = decltype(value);
          if (mem)
            memory<T>(comm, c);
          else if (byt)
            bytes<T>(comm, reps);
          else
            overlap<T>(comm, reps);
        };
        if (!error.empty()) {  // every rank read the same command line
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_ring: %s\n", error.c_str());
          return 2;
        }
        if (dtype == "fp32")
          run(float{});
        else if (dtype == "bf16")
          run(blockattn::bf16{});
        else
          run(blockattn::fp16{});
        return 0;
      });
}
