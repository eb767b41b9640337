// SPDX-License-Identifier: Apache-2.0
// Distributed decode (serving) over P ranks: one decode step over a KV cache
// sharded round-robin, measured with the tree and the ring merge, next to
// the planner's prediction (plan/decode.hpp) from rates measured in the same
// run: the ranks' concurrent read of their shards, and ping-pong latency and
// bandwidth between neighbours.
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../tools/cli_args.hpp"
#include "mpi_main.hpp"

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
using Comm = blockattn::MpiCommunicator<>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The slowest rank's best-of-reps seconds of f() (all ranks start together).
template <class F>
double timed(Comm& comm, int reps, F&& f) {
  f();
  Kokkos::fence();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    const double t0 = now();
    f();
    Kokkos::fence();
    best = std::min(best, comm.allreduce(now() - t0, blockattn::ReduceOp::max));
  }
  return best;
}

/// Ping-pong between ranks 0 and 1 (P > 1): one-way seconds of `bytes`.
double one_way(Comm& comm, std::size_t bytes, int reps) {
  if (comm.size() < 2) return 0.0;
  std::vector<char> buf(std::max<std::size_t>(bytes, 1));
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    comm.barrier();
    const double t0 = now();
    for (int i = 0; i < 10; ++i) {
      if (comm.rank() == 0) {
        MPI_Send(buf.data(), int(bytes), MPI_BYTE, 1, 5, MPI_COMM_WORLD);
        MPI_Recv(buf.data(), int(bytes), MPI_BYTE, 1, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (comm.rank() == 1) {
        MPI_Recv(buf.data(), int(bytes), MPI_BYTE, 0, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf.data(), int(bytes), MPI_BYTE, 0, 5, MPI_COMM_WORLD);
      }
    }
    if (r > 0) best = std::min(best, (now() - t0) / 20);
  }
  return comm.allreduce(comm.rank() == 0 ? best : 0.0, blockattn::ReduceOp::max);
}

template <class T>
void run(Comm& comm, blockattn::index_type cache_len, int batch, int heads, int kv_heads, int dim,
         int reps) {
  using CT = blockattn::compute_t<T>;
  const int P = comm.size();
  const blockattn::RoundRobinPlacement pl{1};
  blockattn::KVCache<T, Exec> cache(comm, batch, pl.local_capacity(cache_len, P), kv_heads, dim,
                                    pl);
  // Fill: the whole cache in chunks (every rank keeps its own tokens).
  const int chunk = 4096;
  Kokkos::View<T****, Mem> kc("k", batch, chunk, kv_heads, dim),
      vc("v", batch, chunk, kv_heads, dim);
  Kokkos::deep_copy(kc, T(0.02f));
  Kokkos::deep_copy(vc, T(0.5f));
  for (blockattn::index_type t = 0; t < cache_len; t += chunk) {
    const int n = int(std::min<blockattn::index_type>(chunk, cache_len - t));
    const auto r = Kokkos::make_pair(0, n);
    cache.append(Exec{}, Kokkos::subview(kc, Kokkos::ALL, r, Kokkos::ALL, Kokkos::ALL),
                 Kokkos::subview(vc, Kokkos::ALL, r, Kokkos::ALL, Kokkos::ALL));
  }
  Kokkos::View<T****, Mem> q("q", batch, 1, heads, dim), o("o", batch, 1, heads, dim);
  Kokkos::View<CT***, Mem> lse("lse", batch, heads, 1);
  Kokkos::deep_copy(q, T(0.01f));
  blockattn::ServeOptions opts;
  opts.check_config = false;  // timed: the step itself (the check is one more small allreduce)
  const double t_tree = timed(comm, reps, [&] {
    blockattn::decode_attention(comm, Exec{}, cache, q, o, lse, blockattn::CausalMask{}, opts);
  });
  opts.merge = blockattn::MergeAlgorithm::ring;
  const double t_ring = timed(comm, reps, [&] {
    blockattn::decode_attention(comm, Exec{}, cache, q, o, lse, blockattn::CausalMask{}, opts);
  });
  // The local part alone: each rank's split-KV over its shard.
  Kokkos::View<blockattn::index_type*, Mem> qpos("qpos", batch);
  Kokkos::deep_copy(qpos, cache_len - 1);
  Kokkos::View<CT****, Mem> op("op", batch, 1, heads, dim);
  blockattn::DecodeOptions dopts;
  dopts.max_length = cache.max_local_length();
  const double t_local = timed(comm, reps, [&] {
    blockattn::attention_decode(Exec{}, q, cache.keys(), cache.values(), cache.local_lengths(),
                                qpos, op, lse, blockattn::CausalMask{}, cache.positions(), dopts);
  });
  // Rates for the prediction, measured now: the concurrent read of the shards
  // (64-bit words, every byte) and the link between two ranks.
  const auto ks = cache.keys(), vs = cache.values();
  const std::int64_t words = std::int64_t(ks.span() * sizeof(T) / 8);
  const auto* pk = reinterpret_cast<const std::uint64_t*>(ks.data());
  const auto* pv = reinterpret_cast<const std::uint64_t*>(vs.data());
  const double t_read = timed(comm, reps, [&] {
    std::uint64_t s = 0;
    Kokkos::parallel_reduce(
        "bench::read", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, words),
        KOKKOS_LAMBDA(const std::int64_t i, std::uint64_t& acc) { acc += pk[i] ^ pv[i]; }, s);
    if (s == 1) std::printf(" ");
  });
  blockattn::plan::DecodeProblem pb;
  pb.cache = cache_len;
  pb.P = P;
  pb.batch = batch;
  pb.heads = heads;
  pb.kv_heads = kv_heads;
  pb.dim = dim;
  pb.dtype_bytes = int(sizeof(T));
  pb.compute_bytes = int(sizeof(CT));
  blockattn::plan::Hardware hw;
  hw.name = "measured";
  hw.memory_bandwidth = double(cache.bytes()) / t_read;
  const double part = double(batch) * heads * (dim + 1) * sizeof(CT);
  const double lat = one_way(comm, 8, reps), t_part = one_way(comm, std::size_t(part), reps);
  hw.latency = lat;
  hw.bandwidth = t_part > lat ? part / (t_part - lat) : 0.0;
  const blockattn::plan::DecodePrediction d = blockattn::plan::predict_decode(hw, pb);
  if (comm.rank() == 0)
    std::printf(
        "%-5s %3d %8lld %3d %3d %3d %4d %9.3f %9.3f %9.3f %9.3f | %9.3f %9.3f %9.3f %7.2f %7.2f\n",
        blockattn::value_type_name<T>(), P, (long long)cache_len, batch, heads, kv_heads, dim,
        t_local * 1e3, t_tree * 1e3, t_ring * 1e3, batch / t_tree, d.local_s * 1e3,
        d.tree_total() * 1e3, d.ring_total() * 1e3, hw.memory_bandwidth * 1e-9, lat * 1e6);
}

}  // namespace

const char* const usage_text = R"(usage: mpiexec -n P blockattn_bench_serve [flags]
One decode step (one query row per sequence) over a KV cache of --keys tokens
per sequence sharded round-robin over the P ranks: measured (ms: the local
split-KV alone, the step with the tree merge, with the ring merge; tokens/s
with the tree) next to the planner's prediction from rates measured in the
same run (read GB/s of the shards, one-way message latency in us).
  --keys N      cached tokens per sequence [65536]
  --batch B     sequences [1]
  --reps R      best of R [5]
  --help, -h    this text
Kokkos' flags pass through. Exit status 2: a bad command line or an error the
library reports (printed by rank 0).
)";

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_serve", usage_text, [&](const int rank) {
        Comm comm(MPI_COMM_WORLD);
        int keys = 65536, batch = 1, reps = 5;
        std::string error;
        for (int i = 1; i < argc && error.empty(); ++i) {
          const std::string f = argv[i];
          if (f != "--keys" && f != "--batch" && f != "--reps")
            error = "unknown argument " + f + " (blockattn_bench_serve --help lists the flags)";
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
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_serve: %s\n", error.c_str());
          return 2;
        }
        if (rank == 0) {
          std::printf("Distributed decode, %d ranks x %d threads (%s), causal, round-robin cache\n",
                      comm.size(), Exec{}.concurrency(), Exec::name());
          std::printf("%-5s %3s %8s %3s %3s %3s %4s %9s %9s %9s %9s | %9s %9s %9s %7s %7s\n",
                      "type", "P", "keys", "B", "H", "Hkv", "D", "local ms", "tree ms", "ring ms",
                      "tokens/s", "pred loc", "pred tree", "pred ring", "read GB/s", "lat us");
        }
        run<float>(comm, keys, batch, 8, 8, 128, reps);
        run<blockattn::bf16>(comm, keys, batch, 8, 8, 128, reps);
        run<float>(comm, keys, batch, 32, 8, 128, reps);
        return 0;
      });
}
