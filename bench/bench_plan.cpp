// SPDX-License-Identifier: Apache-2.0
// Prediction vs measurement (run under mpiexec; see bench/run_plan.sh).
//
// 1. Calibrates the planner on this machine, all ranks at once: the tile
//    kernel's rate on full tiles and the cost of a partial tile (forward on one
//    local block, full and causal mask), the bandwidth of a ring exchange of
//    one K/V block and the latency of a small message.
// 2. Runs the distributed forward (--pass backward: the backward, whose
//    calibration adds the backward on one local block) for every partition x
//    schedule (causal mask by default): best of R of the slowest rank's time.
// 3. Prints measured and predicted time and their ratio, and the measured and
//    predicted speedups over the contiguous ring, all from this one run; and
//    the busiest rank's compute time (StepStats::compute_seconds summed; the
//    planner's RankPlan::busy_s), which separates the kernel model's error
//    from the waits'.
//
//   blockattn_bench_plan [--n-local n] [--heads H] [--dim D] [--reps R] [--mask causal|window:W]
//                        [--pass forward|backward]
#include <blockattn/blockattn.hpp>
#include <blockattn/calibrate.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "../tools/cli_args.hpp"
#include "mpi_main.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace blockattn;
using T = float;
using V4 = Kokkos::View<T****>;
using V3 = Kokkos::View<T***>;
using Comm = MpiCommunicator<>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Args {
  int n_local = 4096, heads = 1, dim = 128, reps = 10;
  std::string mask = "causal";
  index_type window = 0;  // --mask window:W
  bool backward = false;  // --pass backward
};

const char* const usage_text = R"(usage: mpiexec -n P blockattn_bench_plan [flags]
Calibrates the planner on this machine, runs the distributed forward (or
backward) for every partition x schedule and prints measured vs predicted time
and speedups.
  --n-local n   tokens per rank [4096]
  --heads H     [1]
  --dim D       head dim [128]
  --reps R      best of R [10]
  --mask M      causal|window:W [causal]
  --pass P      forward|backward [forward]
  --help, -h    this text
Kokkos' flags (--kokkos-num-threads=N, ...) pass through. Exit status 2: a bad
command line or an error the library reports (printed by rank 0).
)";

/// Fills `a` from the command line; returns what is wrong with it, or "".
std::string parse(int argc, char** argv, Args& a) {
  using blockattn_cli::read_int;
  for (int i = 1; i < argc; i += 2) {
    const std::string f = argv[i];
    if (f != "--n-local" && f != "--heads" && f != "--dim" && f != "--reps" && f != "--mask" &&
        f != "--pass")
      return "unknown argument " + f + " (blockattn_bench_plan --help lists the flags)";
    if (i + 1 >= argc) return f + " needs a value";
    const std::string v = argv[i + 1];
    std::string error;
    if (f == "--n-local")
      error = read_int(f, v, a.n_local);
    else if (f == "--heads")
      error = read_int(f, v, a.heads);
    else if (f == "--dim")
      error = read_int(f, v, a.dim);
    else if (f == "--reps")
      error = read_int(f, v, a.reps);
    else if (f == "--pass") {
      if (v == "forward" || v == "backward")
        a.backward = v == "backward";
      else
        error = f + ": expected forward or backward, got '" + v + "'";
    } else if (v == "causal")
      a.mask = v;
    else if (v.rfind("window:", 0) == 0 && read_int(f, v.substr(7), a.window).empty())
      a.mask = v;
    else
      error = f + ": expected causal or window:W with W >= 1, got '" + v + "'";
    if (!error.empty()) return error;
  }
  return "";
}

/// One forward (or backward) of a partition x schedule on its own local Views; returns the
/// slowest rank's time and keeps the run's step count and the most bytes any
/// rank sent; `predict` is the planner's view of the same run.
struct Runner {
  std::function<double()> once;
  std::function<plan::Prediction(const plan::Problem&, const plan::Hardware&)> predict;
  std::string partition, schedule;
  std::shared_ptr<int> steps = std::make_shared<int>(0);
  std::shared_ptr<std::int64_t> max_sent = std::make_shared<std::int64_t>(0);
  /// The busiest rank's compute seconds, least over the runs.
  std::shared_ptr<double> busy = std::make_shared<double>(1e300);
};

/// A Runner of any driver with DistributedAttention's forward().
template <class Attn, class Predict>
Runner runner_for(Comm& comm, const Args& a, std::shared_ptr<Attn> attn, Predict predict,
                  std::string partition, std::string schedule) {
  V4 q("q", 1, a.n_local, a.heads, a.dim), k("k", 1, a.n_local, a.heads, a.dim),
      v("v", 1, a.n_local, a.heads, a.dim), o("o", 1, a.n_local, a.heads, a.dim);
  V3 lse("lse", 1, a.heads, a.n_local);
  Kokkos::deep_copy(q, T(0.01) * T(comm.rank() + 1));
  Kokkos::deep_copy(k, T(0.02));
  Kokkos::deep_copy(v, T(1));
  // The backward's inputs: this forward's O and LSE, dO = q; its gradients.
  V4 dq, dk, dv;
  if (a.backward) {
    dq = V4("dq", 1, a.n_local, a.heads, a.dim);
    dk = V4("dk", 1, a.n_local, a.heads, a.dim);
    dv = V4("dv", 1, a.n_local, a.heads, a.dim);
    attn->forward(q, k, v, o, lse);
  }
  const bool backward = a.backward;
  Comm* c = &comm;
  Runner r;
  r.partition = std::move(partition);
  r.schedule = std::move(schedule);
  r.predict = predict;
  auto steps = r.steps;
  auto max_sent = r.max_sent;
  auto busy = r.busy;
  r.once = [=]() {
    c->barrier();
    const double t0 = now();
    const RunStats s =
        backward ? attn->backward(q, k, v, o, lse, q, dq, dk, dv) : attn->forward(q, k, v, o, lse);
    Kokkos::fence();
    const double t = c->allreduce(now() - t0, ReduceOp::max);
    *steps = int(s.steps.size());
    *max_sent = c->allreduce(s.bytes_sent(), ReduceOp::max);
    double compute = 0;
    for (const auto& st : s.steps) compute += st.compute_seconds;
    *busy = std::min(*busy, c->allreduce(compute, ReduceOp::max));
    return t;
  };
  return r;
}

template <class Partition, class Schedule, class Mask>
Runner make_runner(Comm& comm, const Args& a, const Mask& mask) {
  using Attn = DistributedAttention<Partition, Mask, Schedule, Comm>;
  return runner_for(
      comm, a, std::make_shared<Attn>(comm, mask),
      [mask](const plan::Problem& pb, const plan::Hardware& hw) {
        return plan::predict<Partition, Schedule>(pb, mask, hw);
      },
      Partition::name(), Schedule::name());
}

template <class Mask>
Runner make_ulysses_runner(Comm& comm, const Args& a, const Mask& mask) {
  using Attn = UlyssesAttention<ContiguousPartition, Mask, Comm>;
  return runner_for(
      comm, a, std::make_shared<Attn>(comm, mask),
      [mask](const plan::Problem& pb, const plan::Hardware& hw) {
        return plan::predict_ulysses<ContiguousPartition>(pb, mask, hw);
      },
      ContiguousPartition::name(), "ulysses");
}

template <class Partition, class Schedule, class Mask>
Runner make_hybrid_runner(Comm& comm, const Args& a, const Mask& mask, int ulysses) {
  using Attn = HybridAttention<Partition, Mask, Schedule, Comm>;
  auto attn = std::make_shared<Attn>(comm, ulysses, mask);
  return runner_for(
      comm, a, attn,
      [mask, ulysses](const plan::Problem& pb, const plan::Hardware& hw) {
        return plan::predict_hybrid<Partition, Schedule>(pb, mask, hw, ulysses);
      },
      Partition::name(),
      "hybrid " + std::to_string(ulysses) + "x" + std::to_string(comm.size() / ulysses) + " " +
          Schedule::name());
}

/// Ring exchange of `bytes` with both neighbours at once (what a ring step
/// does): bytes / best time.
double exchange_bandwidth(Comm& comm, std::size_t bytes, int reps) {
  Kokkos::View<char*> s("s", bytes), r("r", bytes);
  double best = 1e300;
  for (int i = 0; i <= reps; ++i) {
    comm.barrier();
    const double t0 = now();
    auto rr = comm.irecv(r, ring_prev(comm), 7);
    auto sr = comm.isend(s, ring_next(comm), 7);
    comm.wait(rr);
    comm.wait(sr);
    const double t = comm.allreduce(now() - t0, ReduceOp::max);
    if (i > 0) best = std::min(best, t);
  }
  return double(bytes) / best;
}

/// Half the round trip of a one-float message between ranks 0 and 1.
double small_message_latency(Comm& comm) {
  if (comm.size() < 2) return 0;
  Kokkos::View<float*> b("b", 1);
  const int reps = 200;
  comm.barrier();
  const double t0 = now();
  for (int i = 0; i < reps; ++i) {
    if (comm.rank() == 0) {
      auto s = comm.isend(b, 1, 9);
      comm.wait(s);
      auto r = comm.irecv(b, 1, 9);
      comm.wait(r);
    } else if (comm.rank() == 1) {
      auto r = comm.irecv(b, 0, 9);
      comm.wait(r);
      auto s = comm.isend(b, 0, 9);
      comm.wait(s);
    }
  }
  return comm.allreduce((now() - t0) / (2.0 * reps), ReduceOp::max);
}

template <class Mask>
void run(Comm& comm, const Args& a, const Mask& mask) {
  const int P = comm.size();
  const index_type N = index_type(a.n_local) * P;
  plan::Problem pb = plan::problem_for<T>(N, P, 1, a.heads, a.heads, a.dim);
  pb.pass = a.backward ? plan::Pass::backward : plan::Pass::forward;
  const double B = exchange_bandwidth(comm, std::size_t(plan::detail::packed_kv_bytes(pb)), a.reps);
  const double lat = small_message_latency(comm);
  // Round robin over the calibration and the combinations, best of R each:
  // this shared machine's load changes over seconds, and so every measurement
  // sees the same changes. Calibration runs on every rank at once (the load of
  // the distributed run).
  std::vector<Runner> runners;
  runners.push_back(make_runner<ContiguousPartition, RingSchedule>(comm, a, mask));
  runners.push_back(make_runner<StripedPartition, RingSchedule>(comm, a, mask));
  runners.push_back(make_runner<ZigzagPartition, RingSchedule>(comm, a, mask));
  if (a.backward)  // the Q ring's forward is the KV ring's
    runners.push_back(make_runner<ZigzagPartition, BurstSchedule>(comm, a, mask));
  if constexpr (!std::is_same<Mask, FullMask>::value)
    runners.push_back(make_runner<ContiguousPartition, BalancedSchedule>(comm, a, mask));
  runners.push_back(make_runner<ContiguousPartition, AllGatherSchedule>(comm, a, mask));
  // Head-parallel: Ulysses when P divides the heads, and the 2D hybrid on
  // every grid 1 < P_a < P whose groups split the heads.
  if (a.heads % P == 0) runners.push_back(make_ulysses_runner(comm, a, mask));
  for (int u = 2; u < P; ++u)
    if (P % u == 0 && a.heads % u == 0)
      runners.push_back(make_hybrid_runner<ZigzagPartition, RingSchedule>(comm, a, mask, u));
  std::vector<double> best(runners.size(), 1e300);
  plan::Calibration cal;
  cal.full_seconds = cal.causal_seconds = 1e300;
  cal.backward_seconds = cal.backward_window_seconds = a.backward ? 1e300 : 0.0;
  for (int r = 0; r <= a.reps; ++r) {
    const plan::Calibration one = plan::calibrate<T>(a.n_local, a.heads, a.dim, 1, {}, a.backward);
    cal.n = one.n;
    cal.heads = one.heads;
    cal.dim = one.dim;
    cal.full_seconds = std::min(cal.full_seconds, one.full_seconds);
    cal.causal_seconds = std::min(cal.causal_seconds, one.causal_seconds);
    if (a.backward) {
      cal.backward_seconds = std::min(cal.backward_seconds, one.backward_seconds);
      cal.backward_window_seconds =
          std::min(cal.backward_window_seconds, one.backward_window_seconds);
    }
    for (std::size_t i = 0; i < runners.size(); ++i) {
      const double t = runners[i].once();
      if (r > 0) best[i] = std::min(best[i], t);  // r = 0 warms up
    }
  }
  cal = plan::fit_calibration<T>(cal);
  const double F = comm.allreduce(cal.flops, ReduceOp::sum) / P;
  const double kappa = comm.allreduce(cal.partial_tile_cost, ReduceOp::sum) / P;
  const double Fb = comm.allreduce(cal.backward_flops, ReduceOp::sum) / P;
  const double kappa_b = comm.allreduce(cal.backward_partial_tile_cost, ReduceOp::sum) / P;
  plan::Hardware hw;
  hw.name = "this machine (calibrated)";
  hw.flops = F;
  hw.partial_tile_cost = kappa;
  hw.backward_flops = Fb;
  hw.backward_partial_tile_cost = kappa_b;
  hw.bandwidth = B;
  hw.latency = lat;

  struct Row {
    std::string partition, schedule;
    double measured, predicted, busy, predicted_busy;
    int steps, predicted_steps;
    std::int64_t sent, predicted_sent;
  };
  std::vector<Row> rows;
  for (std::size_t i = 0; i < runners.size(); ++i) {
    const plan::Prediction pr = runners[i].predict(pb, hw);
    double pbusy = 0;
    for (const auto& rk : pr.ranks) pbusy = std::max(pbusy, rk.busy_s());
    rows.push_back({runners[i].partition, runners[i].schedule, best[i], pr.makespan_s,
                    *runners[i].busy, pbusy, *runners[i].steps, pr.steps(), *runners[i].max_sent,
                    pr.max_bytes_sent()});
  }

  if (comm.rank() != 0) return;
  std::printf(
      "%s: P = %d ranks x %d thread(s), N = %lld (%d per rank), heads %d, D = %d, fp32, "
      "mask %s, tiles %dx%d\n",
      a.backward ? "backward" : "forward", P, Kokkos::DefaultExecutionSpace().concurrency(),
      (long long)N, a.n_local, a.heads, a.dim, a.mask.c_str(),
      a.backward ? pb.backward_block_q() : pb.block_q,
      a.backward ? pb.backward_block_k() : pb.block_k);
  std::printf(
      "calibrated: F = %.1f GFLOP/s on full tiles, partial tile = %.2f full tiles, "
      "B = %.2f GB/s (ring exchange of one K/V block), latency %.1f us\n",
      F / 1e9, kappa, B / 1e9, lat * 1e6);
  if (a.backward)
    std::printf(
        "calibrated: backward F = %.1f GFLOP/s on full tiles (10 D FLOPs per pair), partial "
        "tile = %.2f full tiles\n",
        Fb / 1e9, kappa_b);
  std::printf("%-11s %-16s %12s %12s %10s %13s %13s %11s %21s %19s\n", "partition", "schedule",
              "measured", "predicted", "pred/meas", "meas vs ring", "pred vs ring", "steps m/p",
              "max sent/rank m/p MB", "busy m/p ms");
  for (const Row& r : rows)
    std::printf(
        "%-11s %-16s %9.2f ms %9.2f ms %10.3f %12.2fx %12.2fx %5d/%-5d %10.2f/%-10.2f "
        "%9.2f/%-9.2f\n",
        r.partition.c_str(), r.schedule.c_str(), r.measured * 1e3, r.predicted * 1e3,
        r.predicted / r.measured, rows[0].measured / r.measured, rows[0].predicted / r.predicted,
        r.steps, r.predicted_steps, double(r.sent) / 1e6, double(r.predicted_sent) / 1e6,
        r.busy * 1e3, r.predicted_busy * 1e3);
  for (const Row& r : rows)
    std::printf(
        "{\"bench\":\"plan\",\"pass\":\"%s\",\"P\":%d,\"n_local\":%d,\"partition\":\"%s\","
        "\"schedule\":"
        "\"%s\",\"measured_s\":%.6g,\"predicted_s\":%.6g,\"ratio\":%.4f,\"steps\":%d,"
        "\"predicted_steps\":%d,\"max_sent\":%lld,\"predicted_max_sent\":%lld,\"busy_s\":%.6g,"
        "\"predicted_busy_s\":%.6g}\n",
        a.backward ? "backward" : "forward", P, a.n_local, r.partition.c_str(), r.schedule.c_str(),
        r.measured, r.predicted, r.predicted / r.measured, r.steps, r.predicted_steps,
        (long long)r.sent, (long long)r.predicted_sent, r.busy, r.predicted_busy);
}

}  // namespace

int main(int argc, char** argv) {
  return bench_mpi::mpi_kokkos_main(
      argc, argv, "blockattn_bench_plan", usage_text, [&](const int rank) {
        Args a;
        const std::string error = parse(argc, argv, a);
        if (!error.empty()) {  // every rank read the same command line
          if (rank == 0) std::fprintf(stderr, "blockattn_bench_plan: %s\n", error.c_str());
          return 2;
        }
        Comm comm(MPI_COMM_WORLD);
        if (a.mask == "causal")
          run(comm, a, CausalMask{});
        else
          run(comm, a, causal_window(a.window));
        return 0;
      });
}
