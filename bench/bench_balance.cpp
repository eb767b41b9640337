// SPDX-License-Identifier: Apache-2.0
// Packed documents: the balance of each layout, run (run under mpiexec; see
// `cmake/blockattn.sh bench-balance`).
//
// A long-tailed document mix (plan::long_tailed_documents) of N tokens with a
// causal document mask; every layout of plan/balance.hpp -- contiguous,
// striped, zigzag, per-document head-tail and the mask-aware assignment -- runs as a
// TablePartition through one DistributedAttention (KV ring, fp32 forward).
// Per layout and rank it prints the tiles the run computed (RunStats) and the
// rank's busy seconds (RunStats::compute_seconds, best of R), next to the
// planner's analysis of the same layout (plan::balance_of):
//   work / ideal   the slowest rank's tiles (full + c x partial, c measured by
//                  plan::calibrate on a causal block, rank 0 alone) over the ideal = the least
//                  total work of the layouts / P;
//   busy / ideal   the slowest rank's busy seconds over the least total busy
//                  seconds of the layouts / P. With more ranks than cores the
//                  ranks share cores and their seconds say little: count work.
//
//   blockattn_bench_balance [--n N] [--seed S] [--heads H] [--dim D] [--chunk C] [--reps R]
//   (--help: usage_text below)
#include <blockattn/blockattn.hpp>
#include <blockattn/calibrate.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "../tools/cli_args.hpp"
#include "mpi_main.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace blockattn;
using T = float;
using Exec = Kokkos::DefaultExecutionSpace;
using V4 = Kokkos::View<T****>;
using V3 = Kokkos::View<T***>;
using Comm = MpiCommunicator<>;
using Table = TablePartition<>;
using Attn = DistributedAttention<Table, DocumentMask, RingSchedule, Comm, Exec>;

struct Args {
  index_type n = 16384, chunk = 0;
  long long seed = 7;
  int heads = 1, dim = 64, reps = 3;
};

const char* const usage_text = R"(usage: mpiexec -n P blockattn_bench_balance [flags]
Packed documents (a long-tailed mix, causal document mask): every layout of
plan/balance.hpp run as a TablePartition through the KV ring (fp32 forward), per
rank the tiles computed and the busy seconds, next to the planner's analysis.
  --n N        global tokens [16384]
  --seed S     the document mix (plan::long_tailed_documents(N, S)) [7]
  --heads H    [1]
  --dim D      head dim [64]
  --chunk C    the mask-aware layout's chunk, a multiple of both tile sizes
               [4 x lcm of the tile sizes]
  --reps R     best of R [3]
  --help, -h   this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports (printed by rank 0).
)";

/// Fills `a` from the command line; returns what is wrong with it, or "".
std::string parse(int argc, char** argv, Args& a) {
  using blockattn_cli::read_int;
  for (int i = 1; i < argc; i += 2) {
    const std::string f = argv[i];
    if (f != "--n" && f != "--seed" && f != "--heads" && f != "--dim" && f != "--chunk" &&
        f != "--reps")
      return "unknown argument " + f + " (blockattn_bench_balance --help lists the flags)";
    if (i + 1 >= argc) return f + " needs a value";
    const std::string v = argv[i + 1];
    const std::string error = f == "--n"       ? read_int(f, v, a.n)
                              : f == "--seed"  ? read_int(f, v, a.seed, 0)
                              : f == "--heads" ? read_int(f, v, a.heads)
                              : f == "--dim"   ? read_int(f, v, a.dim)
                              : f == "--chunk" ? read_int(f, v, a.chunk)
                                               : read_int(f, v, a.reps);
    if (!error.empty()) return error;
  }
  return "";
}

/// What one layout did on every rank (gathered on every rank).
struct Measured {
  std::vector<std::int64_t> full, partial;
  std::vector<double> busy;
  double wall = 0;
};

Measured run(Comm& comm, const Args& a, const plan::Layout& layout, const DocumentMask& mask) {
  const int P = comm.size(), rank = comm.rank();
  const Table part(layout.ranks);
  const int n = int(local_length(part, a.n, P, rank));
  V4 q("q", 1, n, a.heads, a.dim), k("k", 1, n, a.heads, a.dim), v("v", 1, n, a.heads, a.dim),
      o("o", 1, n, a.heads, a.dim);
  V3 lse("lse", 1, a.heads, n);
  Kokkos::deep_copy(q, T(0.01) * T(rank + 1));
  Kokkos::deep_copy(k, T(0.02));
  Kokkos::deep_copy(v, T(1));
  Attn attn(comm, part, mask);
  RunStats best;
  double best_busy = 1e300, wall = 1e300;
  for (int r = 0; r <= a.reps; ++r) {  // one warm-up
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const RunStats s = attn.forward(q, k, v, o, lse);
    Kokkos::fence();
    const double t =
        comm.allreduce(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                       ReduceOp::max);
    if (r == 0) continue;
    wall = std::min(wall, t);
    if (s.compute_seconds() < best_busy) {
      best_busy = s.compute_seconds();
      best = s;
    }
  }
  Measured m;
  m.wall = wall;
  const TileCounts t = best.tiles();
  for (int r = 0; r < P; ++r) {  // gather by sums of one-hot vectors
    m.full.push_back(comm.allreduce(r == rank ? t.full : std::int64_t(0), ReduceOp::sum));
    m.partial.push_back(comm.allreduce(r == rank ? t.partial : std::int64_t(0), ReduceOp::sum));
    m.busy.push_back(comm.allreduce(r == rank ? best_busy : 0.0, ReduceOp::sum));
  }
  return m;
}

/// Every layout run as a TablePartition next to the planner (the report).
void bench(Comm& comm, const Args& a) {
  const int P = comm.size(), rank = comm.rank();
  const std::vector<index_type> off = plan::long_tailed_documents(a.n, std::uint64_t(a.seed));
  Documents<> docs(off);
  const DocumentMask mask = docs.mask();
  const DocumentMask host_mask = plan::host_document_mask(off);
  const TileSizes ts = forward_tile_sizes<T, Exec>(a.dim);
  const index_type chunk = a.chunk > 0 ? a.chunk : 4 * index_type(std::lcm(ts.block_q, ts.block_k));
  // The partial-tile cost of this machine, measured by rank 0 alone while the
  // others sleep (not spin in MPI): with more ranks than cores a calibration
  // on every rank at once measures the sharing, not the tiles.
  double c = 0;
  if (rank == 0) c = plan::calibrate<T, Exec>(2048, a.heads, a.dim, 3).partial_tile_cost;
  {
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    for (int done = 0; MPI_Test(&req, &done, MPI_STATUS_IGNORE), !done;)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  c = comm.allreduce(c, ReduceOp::sum);
  std::vector<index_type> len;
  for (std::size_t d = 0; d + 1 < off.size(); ++d) len.push_back(off[d + 1] - off[d]);
  std::sort(len.begin(), len.end());
  if (rank == 0) {
    std::printf(
        "BlockAttn layout balance, run: N = %lld, P = %d, H = %d, D = %d, fp32 forward, KV "
        "ring, %s (%d threads per rank)\n",
        (long long)a.n, P, a.heads, a.dim, Exec::name(), Exec().concurrency());
    std::printf(
        "documents: %zu, long-tailed (Pareto alpha 1.1, at least 64 tokens, seed %lld): "
        "lengths %lld .. %lld, median %lld; causal within each document\n",
        len.size(), a.seed, (long long)len.front(), (long long)len.back(),
        (long long)len[len.size() / 2]);
    std::printf(
        "tiles %d x %d; a partial tile costs %.2f x a full one (plan::calibrate here, rank 0 "
        "alone); "
        "mask-aware chunk %lld tokens\n\n",
        ts.block_q, ts.block_k, c, (long long)chunk);
  }
  std::vector<plan::Layout> layouts;
  layouts.push_back(plan::layout_of<ContiguousPartition>(a.n, P));
  layouts.push_back(plan::layout_of<StripedPartition>(a.n, P));
  layouts.push_back(plan::layout_of<ZigzagPartition>(a.n, P));
  layouts.push_back(plan::per_document_zigzag(off, P));
  layouts.push_back(plan::mask_balanced(host_mask, a.n, P, chunk, ts.block_q, ts.block_k, c));
  std::vector<plan::Balance> planned;
  std::vector<Measured> measured;
  double least_work = 0, least_busy = 0;
  for (const auto& l : layouts) {
    planned.push_back(plan::balance_of(l, host_mask, ts.block_q, ts.block_k, c, false));
    measured.push_back(run(comm, a, l, mask));
    const Measured& m = measured.back();
    double work = 0, busy = 0;
    for (int r = 0; r < P; ++r) {
      work += double(m.full[std::size_t(r)]) + c * double(m.partial[std::size_t(r)]);
      busy += m.busy[std::size_t(r)];
    }
    if (least_work == 0 || work < least_work) least_work = work;
    if (least_busy == 0 || busy < least_busy) least_busy = busy;
  }
  if (rank == 0) {
    std::printf("%-16s %12s %11s %13s %16s %13s %12s\n", "layout", "tokens/rank", "total work",
                "work / ideal", "planner / ideal", "busy / ideal", "wall ms");
    for (std::size_t i = 0; i < layouts.size(); ++i) {
      const Measured& m = measured[i];
      double work = 0, most = 0, busy = 0;
      for (int r = 0; r < P; ++r) {
        const double w = double(m.full[std::size_t(r)]) + c * double(m.partial[std::size_t(r)]);
        work += w;
        most = std::max(most, w);
        busy = std::max(busy, m.busy[std::size_t(r)]);
      }
      const auto [lo, hi] = std::minmax_element(planned[i].tokens.begin(), planned[i].tokens.end());
      char toks[40];
      std::snprintf(toks, sizeof toks, *lo == *hi ? "%lld" : "%lld..%lld", (long long)*lo,
                    (long long)*hi);
      std::printf("%-16s %12s %10.3fx %13.3f %16.3f %13.3f %12.1f\n", layouts[i].name.c_str(), toks,
                  work / least_work, most / (least_work / P),
                  planned[i].max_cost() / (least_work / P), busy / (least_busy / P), 1e3 * m.wall);
    }
    std::printf("\nper rank: tiles run (full + partial) = planner's; busy ms\n");
    for (std::size_t i = 0; i < layouts.size(); ++i) {
      std::printf("%s\n", layouts[i].name.c_str());
      for (int r = 0; r < P; ++r) {
        const Measured& m = measured[i];
        const TileCounts& p = planned[i].ranks[std::size_t(r)];
        const bool same =
            p.full == m.full[std::size_t(r)] && p.partial == m.partial[std::size_t(r)];
        std::printf("  rank %3d  %9lld + %8lld  %s  %10.2f\n", r, (long long)m.full[std::size_t(r)],
                    (long long)m.partial[std::size_t(r)], same ? "=" : "!= planner",
                    1e3 * m.busy[std::size_t(r)]);
      }
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_balance", usage_text, [&](const int rank) {
        Args a;
        const std::string error = parse(argc, argv, a);
        if (!error.empty()) {
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_balance: %s\n", error.c_str());
          return 2;
        }
        Comm comm(MPI_COMM_WORLD);
        bench(comm, a);
        return 0;
      });
}
