// SPDX-License-Identifier: Apache-2.0
// BlockAttn demo: one causal attention over a sequence split across the MPI
// ranks, with the KV ring, for the contiguous (Ring Attention), striped
// (Striped Attention) and zigzag partitions; then head-parallel: Ulysses (when
// P divides the heads) and the 2D hybrid on every grid P_a x P_r with
// 1 < P_a < P (P_a dividing P and the heads; zigzag ring across groups). Each
// result is checked against the single-device forward of the whole sequence.
// Prints per row: wall time, per-step work imbalance (max / mean over ranks of
// the computed tiles, averaged over steps), tiles skipped, bytes moved (ring
// and all-to-all), max error; then JSON lines.
//
//   mpiexec -n 2 ./blockattn_demo [--n N] [--d D] [--heads H] [--batch B] [--reps R]
//                                 [--dtype fp32|fp64|bf16|fp16] (--fp64: --dtype fp64)
// bf16 / fp16: Q, K, V, O in 16 bits, K/V blocks travel in 16 bits (the bytes
// column halves), LSE and all sums in fp32.
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "../tools/cli_args.hpp"  // strict numbers, --help

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

struct Args {
  int n = 8192, d = 128, heads = 2, batch = 1, reps = 3;
  std::string dtype = "fp32";
};

const char* const usage_text = R"(usage: mpiexec -n P blockattn_demo [flags]
Causal attention over P ranks with every partition x schedule (and Ulysses,
the 2D hybrid), checked against the single-device result of the same global
sequence: time, load imbalance, skipped tiles, bytes and error per row.
  --n N        global sequence length, a multiple of 2P [8192]
  --d D        head dim, 1 .. 256 [128]
  --heads H    [2]
  --batch B    [1]
  --reps R     best of R [3]
  --dtype T    fp32|fp64|bf16|fp16 [fp32]; --fp64 is --dtype fp64
  --help, -h   this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through.
)";

/// The command line; throws std::invalid_argument naming the flag.
Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&](int& out) {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + f);
      const std::string error = blockattn_cli::read_int(f, argv[++i], out);
      if (!error.empty()) throw std::invalid_argument(error);
    };
    if (f == "--n")
      value(a.n);
    else if (f == "--d")
      value(a.d);
    else if (f == "--heads")
      value(a.heads);
    else if (f == "--batch")
      value(a.batch);
    else if (f == "--reps")
      value(a.reps);
    else if (f == "--fp64")
      a.dtype = "fp64";
    else if (f == "--dtype" && i + 1 < argc)
      a.dtype = argv[++i];
    else if (f.rfind("--kokkos", 0) != 0)
      throw std::invalid_argument("unknown option " + f + " (--help lists the flags)");
  }
  return a;
}

struct Row {
  std::string partition, schedule;
  double seconds = 0, imbalance = 0, max_err = 0;
  std::int64_t skipped = 0, computed = 0, bytes = 0;
};

/// One driver (DistributedAttention, UlyssesAttention, HybridAttention) on
/// this rank's part of the global sequence; `local` copies a global View to
/// its layout.
template <class T, class Attn, class Local>
Row run(blockattn::MpiCommunicator<>& comm, const Args& a, Attn& attn, const Local& local,
        std::string partition, std::string schedule, int heads_per_rank) {
  using V4 = Kokkos::View<T****>;
  using V3 = Kokkos::View<blockattn::compute_t<T>***>;
  const int P = comm.size(), n = a.n / P;
  const Kokkos::DefaultExecutionSpace exec;
  // The global sequence (same on every rank) and its single-device result.
  V4 q("q", a.batch, a.n, a.heads, a.d), k("k", a.batch, a.n, a.heads, a.d),
      v("v", a.batch, a.n, a.heads, a.d), o("o", a.batch, a.n, a.heads, a.d);
  V3 lse("lse", a.batch, a.heads, a.n);
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> u(-1, 1);
  for (auto view : {q, k, v}) {
    auto h = Kokkos::create_mirror_view(view);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = T(u(rng));
    Kokkos::deep_copy(view, h);
  }
  blockattn::attention_forward(exec, q, k, v, o, lse, blockattn::CausalMask{});

  // This rank's part, in the driver's layout.
  V4 ql("ql", a.batch, n, a.heads, a.d), kl("kl", a.batch, n, a.heads, a.d),
      vl("vl", a.batch, n, a.heads, a.d), ol("ol", a.batch, n, a.heads, a.d),
      oref("oref", a.batch, n, a.heads, a.d);
  V3 ll("ll", a.batch, a.heads, n);
  local(q, ql);
  local(k, kl);
  local(v, vl);
  local(o, oref);

  Row row;
  row.partition = std::move(partition);
  row.schedule = std::move(schedule);
  row.seconds = 1e30;
  blockattn::RunStats stats;
  for (int r = 0; r < a.reps; ++r) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    stats = attn.forward(ql, kl, vl, ol, ll);
    Kokkos::fence();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    row.seconds = std::min(row.seconds, comm.allreduce(t, blockattn::ReduceOp::max));
  }
  // Work imbalance per step: max / mean over ranks of the tiles computed.
  double imb = 0;
  int steps = 0;
  for (const auto& s : stats.steps) {
    const double w = double(s.tiles.computed());
    const double mx = comm.allreduce(w, blockattn::ReduceOp::max);
    const double mean = comm.allreduce(w, blockattn::ReduceOp::sum) / P;
    if (mean > 0) {
      imb += mx / mean;
      ++steps;
    }
  }
  row.imbalance = steps ? imb / steps : 1.0;
  // Tiles are counted per (batch, head) of the heads this rank computes.
  const std::int64_t heads = std::int64_t(a.batch) * heads_per_rank;
  row.skipped = comm.allreduce(stats.tiles().skipped * heads, blockattn::ReduceOp::sum);
  row.computed = comm.allreduce(stats.tiles().computed() * heads, blockattn::ReduceOp::sum);
  row.bytes = comm.allreduce(stats.bytes_sent(), blockattn::ReduceOp::sum);
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ol);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), oref);
  double err = 0;
  for (std::size_t i = 0; i < oh.size(); ++i)
    err = std::max(err, std::abs(double(oh.data()[i]) - double(rh.data()[i])));
  row.max_err = comm.allreduce(err, blockattn::ReduceOp::max);
  return row;
}

template <class T, class Partition>
Row run_ring(blockattn::MpiCommunicator<>& comm, const Args& a) {
  blockattn::DistributedAttention<Partition, blockattn::CausalMask, blockattn::RingSchedule,
                                  blockattn::MpiCommunicator<>>
      attn(comm);
  const int P = comm.size(), rank = comm.rank();
  return run<T>(
      comm, a, attn,
      [&](const auto& g, const auto& l) {
        blockattn::to_local<Partition>(Kokkos::DefaultExecutionSpace(), P, rank, g, l);
      },
      Partition::name(), "ring", a.heads);
}

template <class T>
int run_all(blockattn::MpiCommunicator<>& comm, const Args& a) {
  using Zigzag = blockattn::ZigzagPartition;
  const int P = comm.size(), rank = comm.rank();
  std::vector<Row> rows = {run_ring<T, blockattn::ContiguousPartition>(comm, a),
                           run_ring<T, blockattn::StripedPartition>(comm, a),
                           run_ring<T, Zigzag>(comm, a)};
  if (a.heads % P == 0) {
    blockattn::UlyssesAttention<Zigzag, blockattn::CausalMask, blockattn::MpiCommunicator<>> attn(
        comm);
    rows.push_back(run<T>(
        comm, a, attn,
        [&](const auto& g, const auto& l) {
          blockattn::to_local<Zigzag>(Kokkos::DefaultExecutionSpace(), P, rank, g, l);
        },
        Zigzag::name(), "ulysses", a.heads / P));
  }
  for (int u = 2; u < P; ++u) {
    if (P % u != 0 || a.heads % u != 0) continue;
    blockattn::HybridAttention<Zigzag, blockattn::CausalMask, blockattn::RingSchedule,
                               blockattn::MpiCommunicator<>>
        attn(comm, u);
    rows.push_back(run<T>(
        comm, a, attn,
        [&](const auto& g, const auto& l) {
          blockattn::hybrid_to_local<Zigzag>(Kokkos::DefaultExecutionSpace(), attn.grid(), rank, g,
                                             l);
        },
        Zigzag::name(), "hybrid " + std::to_string(u) + "x" + std::to_string(P / u) + " ring",
        a.heads / u));
  }
  // Distributed vs single device differ by rounding only (keys merged in
  // another order): fp64 1e-12, fp32 1e-5, as in tests/test_distributed.cpp;
  // 16 bits: both are fp32 results rounded once, so they may also sit on the
  // two sides of a rounding boundary: one ulp at |O| <= 1 (2 u16) more.
  double tol = std::is_same<T, double>::value ? 1e-12 : 1e-5;
  if constexpr (blockattn::is_half_storage_v<T>) tol += 2 * T::unit_roundoff;
  const char* dtype = blockattn::value_type_name<T>();
  int failures = 0;
  if (comm.rank() == 0) {
    std::printf(
        "BlockAttn demo: causal attention over %d MPI ranks x %d %s thread(s), "
        "%s, B=%d H=%d N=%d D=%d (N/P=%d per rank)\n",
        comm.size(), Kokkos::DefaultExecutionSpace().concurrency(),
        Kokkos::DefaultExecutionSpace::name(), dtype, a.batch, a.heads, a.n, a.d,
        a.n / comm.size());
    std::printf("%-11s %-16s %10s %10s %10s %10s %12s %10s %s\n", "partition", "schedule",
                "time[ms]", "imbalance", "computed", "skipped", "bytes", "max_err", "check");
  }
  for (const Row& r : rows) {
    const bool ok = r.max_err <= tol;
    failures += !ok;
    if (comm.rank() == 0)
      std::printf("%-11s %-16s %10.2f %10.3f %10lld %10lld %12lld %10.2e %s\n", r.partition.c_str(),
                  r.schedule.c_str(), r.seconds * 1e3, r.imbalance, (long long)r.computed,
                  (long long)r.skipped, (long long)r.bytes, r.max_err, ok ? "OK" : "FAIL");
  }
  if (comm.rank() == 0)
    for (const Row& r : rows)
      std::printf(
          "{\"partition\":\"%s\",\"schedule\":\"%s\",\"mask\":\"causal\",\"ranks\":%d,"
          "\"n\":%d,\"d\":%d,\"heads\":%d,\"batch\":%d,\"dtype\":\"%s\",\"seconds\":%.6g,"
          "\"imbalance\":%.4f,\"tiles_computed\":%lld,\"tiles_skipped\":%lld,"
          "\"bytes\":%lld,\"max_err\":%.3g}\n",
          r.partition.c_str(), r.schedule.c_str(), comm.size(), a.n, a.d, a.heads, a.batch, dtype,
          r.seconds, r.imbalance, (long long)r.computed, (long long)r.skipped, (long long)r.bytes,
          r.max_err);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (blockattn_cli::wants_help(argc, argv)) {  // before Kokkos, which has its own --help
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::fputs(usage_text, stdout);
    MPI_Finalize();
    return 0;
  }
  Kokkos::initialize(argc, argv);
  int failures = 0;
  {
    blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
    try {
      const Args a = parse(argc, argv);
      if (a.dtype == "fp64")
        failures = run_all<double>(comm, a);
      else if (a.dtype == "bf16")
        failures = run_all<blockattn::bf16>(comm, a);
      else if (a.dtype == "fp16")
        failures = run_all<blockattn::fp16>(comm, a);
      else if (a.dtype == "fp32")
        failures = run_all<float>(comm, a);
      else
        throw std::invalid_argument("--dtype: expected fp32, fp64, bf16 or fp16, got '" + a.dtype +
                                    "'");
    } catch (const std::exception& e) {
      // The same command line and the library's collective checks: every
      // rank meets the same error; rank 0 says it.
      if (comm.rank() == 0) std::fprintf(stderr, "blockattn_demo: %s\n", e.what());
      failures = -1;
    }
  }
  Kokkos::finalize();
  MPI_Finalize();
  return failures == 0 ? 0 : failures < 0 ? 2 : 1;
}
