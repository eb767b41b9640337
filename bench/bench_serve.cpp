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

/// A mixed step: `batch` sequences of cache_len tokens decode one row each
/// while one more sequence prefills a chunk of `chunk` rows. Timed three
/// ways on the same caches: one batch_attention call; the same work as
/// separate prefill_attention calls (one per sequence: the bits
/// batch_attention reproduces); and the two calls a step took before
/// batch_attention (append_kv and decode_attention over a cache of the
/// decoding sequences, prefill_attention of the chunk on a second cache).
template <class T>
void run_mixed(Comm& comm, blockattn::index_type cache_len, int batch, int chunk, int heads,
               int kv_heads, int dim, int reps) {
  using CT = blockattn::compute_t<T>;
  const int P = comm.size();
  const blockattn::RoundRobinPlacement pl{1};
  // Room for the fill, the warm-up and reps steps of each timing.
  const blockattn::index_type room = cache_len + std::int64_t(3 * (reps + 1) + 1) * chunk;
  blockattn::KVCache<T, Exec> cache(comm, batch + 1, pl.local_capacity(room, P), kv_heads, dim, pl),
      decoding(comm, batch, pl.local_capacity(room, P), kv_heads, dim, pl),
      prefilling(comm, 1, pl.local_capacity(room, P), kv_heads, dim, pl);
  const int fill = 4096;
  Kokkos::View<T****, Mem> kc("k", batch, fill, kv_heads, dim), vc("v", batch, fill, kv_heads, dim);
  Kokkos::deep_copy(kc, T(0.02f));
  Kokkos::deep_copy(vc, T(0.5f));
  const auto all = Kokkos::ALL;
  for (blockattn::index_type t = 0; t < cache_len; t += fill) {
    const int n = int(std::min<blockattn::index_type>(fill, cache_len - t));
    const auto r = Kokkos::make_pair(0, n);
    decoding.append(Exec{}, Kokkos::subview(kc, all, r, all, all),
                    Kokkos::subview(vc, all, r, all, all));
    for (int s = 0; s < batch; ++s)
      cache.append(Exec{}, s, Kokkos::subview(kc, Kokkos::make_pair(s, s + 1), r, all, all),
                   Kokkos::subview(vc, Kokkos::make_pair(s, s + 1), r, all, all));
  }
  const int rows = batch + chunk;
  Kokkos::View<T****, Mem> q("q", 1, rows, heads, dim), k("k", 1, rows, kv_heads, dim),
      v("v", 1, rows, kv_heads, dim), o("o", 1, rows, heads, dim);
  Kokkos::View<CT***, Mem> lse("lse", 1, heads, rows);
  Kokkos::deep_copy(q, T(0.01f));
  Kokkos::deep_copy(k, T(0.02f));
  Kokkos::deep_copy(v, T(0.5f));
  blockattn::ServeBatch mix;
  for (int s = 0; s <= batch; ++s) {
    mix.sequences.push_back(s);
    mix.rows.push_back(s < batch ? 1 : chunk);
  }
  blockattn::ServeOptions opts;
  const double t_batch = timed(comm, reps, [&] {
    blockattn::batch_attention(comm, Exec{}, cache, mix, q, k, v, o, lse, blockattn::CausalMask{},
                               opts);
  });
  const auto part = [&](const auto& x, int i) {
    return Kokkos::subview(
        x, all,
        Kokkos::make_pair(int(mix.offset(std::size_t(i))), int(mix.offset(std::size_t(i) + 1))),
        all, all);
  };
  const double t_separate = timed(comm, reps, [&] {
    for (int i = 0; i <= batch; ++i)
      blockattn::prefill_attention(
          comm, Exec{}, cache, i, part(q, i), part(k, i), part(v, i), part(o, i),
          Kokkos::subview(lse, all, all,
                          Kokkos::make_pair(int(mix.offset(std::size_t(i))),
                                            int(mix.offset(std::size_t(i) + 1)))),
          blockattn::CausalMask{}, opts);
  });
  // Two calls: the decoding sequences' new rows as (batch, 1, ...).
  Kokkos::View<T****, Mem> q1("q1", batch, 1, heads, dim), k1("k1", batch, 1, kv_heads, dim),
      v1("v1", batch, 1, kv_heads, dim), o1("o1", batch, 1, heads, dim);
  Kokkos::View<CT***, Mem> l1("l1", batch, heads, 1);
  Kokkos::deep_copy(q1, T(0.01f));
  Kokkos::deep_copy(k1, T(0.02f));
  Kokkos::deep_copy(v1, T(0.5f));
  const auto last = Kokkos::make_pair(batch, rows);
  const double t_two = timed(comm, reps, [&] {
    blockattn::append_kv(comm, Exec{}, decoding, -1, k1, v1, opts);
    blockattn::decode_attention(comm, Exec{}, decoding, q1, o1, l1, blockattn::CausalMask{}, opts);
    blockattn::prefill_attention(
        comm, Exec{}, prefilling, 0, Kokkos::subview(q, all, last, all, all),
        Kokkos::subview(k, all, last, all, all), Kokkos::subview(v, all, last, all, all),
        Kokkos::subview(o, all, last, all, all), Kokkos::subview(lse, all, all, last),
        blockattn::CausalMask{}, opts);
  });
  if (comm.rank() == 0)
    std::printf("%-5s %3d %8lld %3d %5d %3d %3d %4d %9.3f %9.3f %9.3f %8.2f %8.2f\n",
                blockattn::value_type_name<T>(), P, (long long)cache_len, batch, chunk, heads,
                kv_heads, dim, t_batch * 1e3, t_separate * 1e3, t_two * 1e3, t_separate / t_batch,
                t_two / t_batch);
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
  --mixed C     instead: a mixed step, B sequences decoding (one row each) and
                one prefilling a chunk of C rows: one batch_attention call,
                the same work as separate prefill_attention calls, and the
                two calls of before (append_kv + decode_attention, then
                prefill_attention); ms, and the others' time / the batch's
  --help, -h    this text
Kokkos' flags pass through. Exit status 2: a bad command line or an error the
library reports (printed by rank 0).
)";

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_serve", usage_text, [&](const int rank) {
        Comm comm(MPI_COMM_WORLD);
        int keys = 65536, batch = 1, reps = 5, mixed = 0;
        std::string error;
        for (int i = 1; i < argc && error.empty(); ++i) {
          const std::string f = argv[i];
          if (f != "--keys" && f != "--batch" && f != "--reps" && f != "--mixed")
            error = "unknown argument " + f + " (blockattn_bench_serve --help lists the flags)";
          else if (i + 1 >= argc)
            error = f + " needs a value";
          else if (f == "--keys")
            error = blockattn_cli::read_int(f, argv[++i], keys, 1, 1 << 24);
          else if (f == "--mixed")
            error = blockattn_cli::read_int(f, argv[++i], mixed, 1, 1 << 16);
          else if (f == "--batch")
            error = blockattn_cli::read_int(f, argv[++i], batch, 1, 4096);
          else
            error = blockattn_cli::read_int(f, argv[++i], reps);
        }
        if (!error.empty()) {
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_serve: %s\n", error.c_str());
          return 2;
        }
        if (mixed > 0) {
          if (rank == 0) {
            std::printf("Mixed serving step, %d ranks x %d threads (%s), causal, round-robin\n",
                        comm.size(), Exec{}.concurrency(), Exec::name());
            std::printf("%-5s %3s %8s %3s %5s %3s %3s %4s %9s %9s %9s %8s %8s\n", "type", "P",
                        "keys", "B", "chunk", "H", "Hkv", "D", "batch ms", "separate", "two calls",
                        "sep/bat", "two/bat");
          }
          run_mixed<float>(comm, keys, batch, mixed, 32, 8, 128, reps);
          run_mixed<blockattn::bf16>(comm, keys, batch, mixed, 32, 8, 128, reps);
          return 0;
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
