// SPDX-License-Identifier: Apache-2.0
// BlockAttn planner CLI: predicts every partition x schedule for a problem on
// given hardware and recommends the fastest one that fits in memory.
//
//   blockattn_plan --n 262144 --p 8 --heads 32 --dim 128 --mask causal --hw a100-nvlink
//   blockattn_plan --n 65536 --p 4 --mask window:8192          (calibrates this machine)
//
// Flags: `blockattn_plan --help` (usage_text below).
#include <blockattn/blockattn.hpp>
#include <blockattn/calibrate.hpp>
#include <blockattn/plan/balance.hpp>

#include "cli_args.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

using namespace blockattn;

/// The most ranks the planner takes: its models run in O(P) memory and, for
/// the balanced schedule, O(P^2) time (about 2 s at P = 16384 on one core).
constexpr int max_ranks = 32768;
/// With a backward (--pass backward, training): its model is O(P x steps)
/// time (about 18 s for a training step at P = 4096 on one core).
constexpr int max_backward_ranks = 4096;

struct Args {
  index_type n = 65536;
  int p = 4, batch = 1, heads = 8, kv_heads = 0, dim = 128, dtype = 4;
  std::string dtype_name = "fp32", mask = "causal", hw = "calibrate", data;
  int block_q = 0, block_k = 0;
  double flops = 0, bandwidth = -1, latency = -1, memory = -1;
  int ranks_per_node = -1;
  double intra_bandwidth = -1, intra_latency = -1;
  bool steps = false, json = false;
  long long balance = -1;  // --balance SEED (>= 0: the balance analysis)
  index_type chunk = 0;
  index_type window = 0;  // --mask window:W
  bool decode = false;    // --decode: the decode step over a sharded KV cache of --n tokens
  int rows = 1;           // --rows: query rows per sequence of the decode step
  double memory_bandwidth = -1;
  plan::Pass pass = plan::Pass::forward;  // --pass
  double backward_flops = 0;              // --backward-flops
};

const char* const usage_text = R"(usage: blockattn_plan [flags]
Predicts every partition x schedule of the distributed forward, backward or
training step for one problem on given hardware and recommends the fastest that
fits in memory.

problem
  --n N                 global sequence length [65536]
  --p P                 ranks, 1 .. 32768 [4]
  --batch B             [1]
  --heads H             query heads [8]
  --kv-heads Hkv        key/value heads, a divisor of H [H]
  --dim D               head dim, 1 .. 256 [128]
  --dtype T             fp32|fp64|bf16|fp16 [fp32]: storage type (K/V and Q travel in
                        it); bf16 / fp16 compute, merge and send partial results in fp32
  --mask M              full|causal|window:W [causal] (window: causal, W keys)
  --tile BQxBK          forward tile sizes [the kernels' own: GPU shape for the GPU/TPU
                        presets, host shape when calibrating]
  --pass P              forward|backward|training [forward]: the forward call, the
                        backward call (given O, LSE, dO), or both in turn (P <= 4096)
hardware
  --hw HW               a100-nvlink|a100-ib|tpu-v3|tpu-v4|tpu-v5e|h100-cluster|calibrate
                        [calibrate: measures this machine's kernel and memcpy]
  --flops F             attention FLOP/s per rank on full tiles     (override the
  --backward-flops F    the backward's, 10 D FLOPs per pair [F]      preset or the
  --bandwidth B         bytes/s per rank and direction               calibration)
  --latency S           seconds per message
  --memory BYTES        per rank; 0: unlimited
  --ranks-per-node R    two link levels (R > 0): ranks r, s with r/R == s/R use the
  --intra-bandwidth B   intra-node rates; with R > 0 the 2D hybrid (all-to-all in
  --intra-latency S     groups x ring) joins the candidates
output
  --steps               per-rank, per-step table of every candidate (P x steps <= 100000)
  --data FILE           per-rank, per-step work for plots (P x steps <= 10000000)
  --json                one JSON line per candidate
layout balance (instead of the schedules)
  --balance SEED        the compute balance of every layout (contiguous, striped, zigzag,
                        per-document head-tail, mask-aware) for causal packed documents
                        of a long-tailed length mix (plan::long_tailed_documents(N, SEED));
                        takes --n, --p, --dim, --dtype, --tile, --hw, --chunk only
  --chunk C             the mask-aware layout's chunk [lcm of the tile sizes x 4]
serving (instead of the schedules)
  --decode              the decode step over a KV cache of --n tokens per sequence,
                        round-robin over P' = 1, 2, 4, ..., --p ranks: the busiest
                        rank's shard read, tree and ring merges, tokens/s;
                        takes --n, --p, --batch, --heads, --kv-heads, --dim, --dtype,
                        --rows and the hardware flags
  --rows R              query rows per sequence (1: decode; more: a speculative or
                        prefill chunk) [1]
  --memory-bandwidth B  device memory read rate, bytes/s per rank [preset; calibrate:
                        2 x memcpy]
  --help, -h            this text
Exit status: 0 a recommendation (or the balance table), 1 nothing fits in memory,
2 a bad command line.
)";

[[noreturn]] void usage(const std::string& what) {
  std::fprintf(stderr, "blockattn_plan: %s (blockattn_plan --help lists the flags)\n",
               what.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  using blockattn_cli::read_int;
  using blockattn_cli::read_real;
  Args a;
  std::vector<std::string> given;  // the flags on the command line
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + f);
      return argv[++i];
    };
    auto check = [](const std::string& error) {
      if (!error.empty()) usage(error);
    };
    given.push_back(f);
    if (f == "--n")
      check(read_int(f, val(), a.n));
    else if (f == "--p")
      check(read_int(f, val(), a.p, 1, max_ranks));
    else if (f == "--batch")
      check(read_int(f, val(), a.batch));
    else if (f == "--heads")
      check(read_int(f, val(), a.heads));
    else if (f == "--kv-heads")
      check(read_int(f, val(), a.kv_heads));
    else if (f == "--dim")  // the library's limit (kernel/options.hpp)
      check(read_int(f, val(), a.dim, 1, max_head_dim));
    else if (f == "--dtype") {
      a.dtype_name = val();
      if (a.dtype_name == "fp32")
        a.dtype = 4;
      else if (a.dtype_name == "fp64")
        a.dtype = 8;
      else if (a.dtype_name == "bf16" || a.dtype_name == "fp16")
        a.dtype = 2;
      else
        usage("--dtype: expected fp32, fp64, bf16 or fp16, got '" + a.dtype_name + "'");
    } else if (f == "--mask")
      a.mask = val();
    else if (f == "--tile") {
      const std::string t = val();
      const std::vector<std::string> bq_bk = blockattn_cli::split(t, 'x');
      if (bq_bk.size() != 2 || !read_int(f, bq_bk[0], a.block_q).empty() ||
          !read_int(f, bq_bk[1], a.block_k).empty())
        usage("--tile: expected BQxBK with positive integers, e.g. 64x64, got '" + t + "'");
    } else if (f == "--hw")
      a.hw = val();
    else if (f == "--flops")
      check(read_real(f, val(), a.flops, true));
    else if (f == "--bandwidth")
      check(read_real(f, val(), a.bandwidth, true));
    else if (f == "--latency")
      check(read_real(f, val(), a.latency, false));
    else if (f == "--memory")  // 0: unlimited
      check(read_real(f, val(), a.memory, false));
    else if (f == "--ranks-per-node")  // 0: one link level
      check(read_int(f, val(), a.ranks_per_node, 0));
    else if (f == "--intra-bandwidth")
      check(read_real(f, val(), a.intra_bandwidth, true));
    else if (f == "--intra-latency")
      check(read_real(f, val(), a.intra_latency, false));
    else if (f == "--data")
      a.data = val();
    else if (f == "--steps")
      a.steps = true;
    else if (f == "--json")
      a.json = true;
    else if (f == "--balance")
      check(read_int(f, val(), a.balance, 0));
    else if (f == "--chunk")
      check(read_int(f, val(), a.chunk));
    else if (f == "--decode")
      a.decode = true;
    else if (f == "--rows")
      check(read_int(f, val(), a.rows, 1, 4096));
    else if (f == "--pass") {
      const std::string v = val();
      if (v == "forward")
        a.pass = plan::Pass::forward;
      else if (v == "backward")
        a.pass = plan::Pass::backward;
      else if (v == "training")
        a.pass = plan::Pass::training;
      else
        usage("--pass: expected forward, backward or training, got '" + v + "'");
    } else if (f == "--backward-flops")
      check(read_real(f, val(), a.backward_flops, true));
    else if (f == "--memory-bandwidth")
      check(read_real(f, val(), a.memory_bandwidth, true));
    else if (f.rfind("--kokkos", 0) != 0)
      usage("unknown option " + f);
  }
  if (a.kv_heads == 0) a.kv_heads = a.heads;
  if (a.mask.rfind("window:", 0) == 0) {
    if (!read_int("--mask window:W", a.mask.substr(7), a.window).empty())
      usage("--mask: expected window:W with W >= 1, got '" + a.mask + "'");
  } else if (a.mask != "full" && a.mask != "causal")
    usage("--mask: expected full, causal or window:W, got '" + a.mask + "'");
  // What the library rejects (kernel/validate.hpp), with its words.
  if (a.heads % a.kv_heads != 0)
    usage("--kv-heads: expected a divisor of --heads (" + std::to_string(a.heads) + "), got " +
          std::to_string(a.kv_heads) + ": k's heads (extent(2)) must divide q's");
  if (a.n / a.p + 1 > index_type(std::numeric_limits<int>::max() / 2))
    usage("--n " + std::to_string(a.n) + " over --p " + std::to_string(a.p) +
          ": a rank's sequence length exceeds the per-call limit of " +
          std::to_string(std::numeric_limits<int>::max() / 2) + " rows");
  if (a.n < a.p && !a.decode)
    usage("--n " + std::to_string(a.n) + ": expected at least --p (" + std::to_string(a.p) +
          ") tokens, one per rank");
  const char* const presets[] = {"a100-nvlink", "a100-ib",      "tpu-v3",   "tpu-v4",
                                 "tpu-v5e",     "h100-cluster", "calibrate"};
  if (std::find(std::begin(presets), std::end(presets), a.hw) == std::end(presets))
    usage(
        "--hw: expected a100-nvlink, a100-ib, tpu-v3, tpu-v4, tpu-v5e, h100-cluster or "
        "calibrate, got '" +
        a.hw + "'");
  const auto has = [&](const char* flag) {
    return std::find(given.begin(), given.end(), flag) != given.end();
  };
  if (a.balance >= 0) {
    for (const char* f :
         {"--mask", "--steps", "--json", "--data", "--batch", "--heads", "--kv-heads", "--flops",
          "--bandwidth", "--latency", "--memory", "--ranks-per-node", "--intra-bandwidth",
          "--intra-latency", "--pass", "--backward-flops"})
      if (has(f))
        usage(std::string(f) +
              " does not apply to --balance (causal packed documents, compute balance only; "
              "it takes --n, --p, --dim, --dtype, --tile, --hw, --chunk)");
  } else if (has("--chunk")) {
    usage("--chunk applies to --balance only (the mask-aware layout's chunk)");
  }
  if (a.pass != plan::Pass::forward && a.p > max_backward_ranks)
    usage(std::string("--pass ") + plan::pass_name(a.pass) + ": expected --p <= " +
          std::to_string(max_backward_ranks) + " (the backward's model walks every step of every " +
          "rank: O(P x steps) time), got " + std::to_string(a.p));
  if (a.decode) {
    for (const char* f : {"--mask", "--steps", "--json", "--data", "--tile", "--balance",
                          "--memory", "--pass", "--backward-flops"})
      if (has(f))
        usage(std::string(f) +
              " does not apply to --decode (it takes --n, --p, --batch, --heads, --kv-heads, "
              "--dim, --dtype, --rows and the hardware flags)");
  } else if (has("--rows") || has("--memory-bandwidth")) {
    usage(std::string(has("--rows") ? "--rows" : "--memory-bandwidth") +
          " applies to --decode only");
  }
  return a;
}

/// Host memcpy bandwidth: what MPI's shared-memory transport moves on one node.
double memcpy_bandwidth(std::size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e300;
  for (int r = 0; r < 4; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    a[std::size_t(r)] = b[bytes - 1 - std::size_t(r)];
  }
  return double(bytes) / best;
}

std::string human(double bytes) {
  char buf[32];
  if (bytes >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

/// --balance: every layout's compute per rank for causal packed documents of
/// a long-tailed length mix, in the tiles of `pb`.
int run_balance(const Args& a, const plan::Problem& pb, const plan::Hardware& hw) {
  const std::vector<index_type> off = plan::long_tailed_documents(a.n, std::uint64_t(a.balance));
  std::vector<index_type> len;
  for (std::size_t d = 0; d + 1 < off.size(); ++d) len.push_back(off[d + 1] - off[d]);
  std::vector<index_type> sorted = len;
  std::sort(sorted.begin(), sorted.end());
  const DocumentMask mask = plan::host_document_mask(off);
  const int bq = pb.block_q, bk = pb.block_k;
  const index_type chunk = a.chunk > 0 ? a.chunk : 4 * index_type(std::lcm(bq, bk));
  std::vector<plan::Layout> layouts;
  std::vector<std::string> skipped;  // layouts that cannot split N over P (printed below)
  const auto add = [&](auto make) {
    try {
      layouts.push_back(make());
    } catch (const std::exception& e) {
      skipped.push_back(e.what());
    }
  };
  add([&] { return plan::layout_of<ContiguousPartition>(a.n, a.p); });
  add([&] { return plan::layout_of<StripedPartition>(a.n, a.p); });
  add([&] { return plan::layout_of<ZigzagPartition>(a.n, a.p); });
  add([&] { return plan::per_document_zigzag(off, a.p); });
  try {
    layouts.push_back(plan::mask_balanced(mask, a.n, a.p, chunk, bq, bk, hw.partial_tile_cost));
  } catch (const std::exception& e) {
    // The chunk is the caller's (--chunk) or derived from the tiles: say which.
    usage(std::string(a.chunk > 0 ? "--chunk " : "the default chunk ") + std::to_string(chunk) +
          ": " + e.what());
  }
  std::printf(
      "problem: N = %lld, P = %d, causal packed documents: %zu (long-tailed mix, seed %lld): "
      "lengths %lld .. %lld, median %lld; tiles %dx%d, partial tile %.2f x a full one\n",
      (long long)a.n, a.p, len.size(), a.balance, (long long)sorted.front(),
      (long long)sorted.back(), (long long)sorted[sorted.size() / 2], bq, bk, hw.partial_tile_cost);
  std::printf(
      "work per rank: the tiles its queries compute against all N keys (full + partial x cost), "
      "under any schedule that brings K/V to the queries (ring, all-gather)\n\n");
  for (const std::string& why : skipped) std::printf("(skipped: %s)\n", why.c_str());
  std::vector<plan::Balance> all;
  double least = 0;  // the least total work of the layouts
  for (const auto& l : layouts) {
    all.push_back(plan::balance_of(l, mask, bq, bk, hw.partial_tile_cost));
    const double t = all.back().total_cost();
    if (least == 0 || t < least) least = t;
  }
  const double ideal = least / a.p;
  std::printf("ideal: the least total work of these layouts / P\n\n");
  std::printf("%-16s %14s %12s %18s %16s\n", "layout", "tokens/rank", "total work",
              "makespan / ideal", "pairs max/mean");
  for (const auto& b : all) {
    const auto [lo, hi] = std::minmax_element(b.tokens.begin(), b.tokens.end());
    char toks[40];
    std::snprintf(toks, sizeof toks, *lo == *hi ? "%lld" : "%lld..%lld", (long long)*lo,
                  (long long)*hi);
    std::printf("%-16s %14s %11.3fx %18.3f %16.3f\n", b.name.c_str(), toks, b.total_cost() / least,
                b.makespan_over(ideal), b.pairs_over_ideal());
  }
  // The picture: each rank's work over the ideal, 20 columns = 1x, at most 3x.
  std::printf("\nper-rank work / ideal (| = ideal, each # = 0.05, > beyond 3)\n");
  for (const auto& b : all) {
    std::printf("%s\n", b.name.c_str());
    for (std::size_t r = 0; r < b.cost.size(); ++r) {
      const double x = ideal > 0 ? b.cost[r] / ideal : 0.0;
      const int n = int(std::lround(x * 20));
      std::string bar;
      for (int i = 0; i < std::min(n, 60); ++i) bar += i == 19 && n > 20 ? '|' : '#';
      if (n <= 20) bar += std::string(std::size_t(20 - n), ' ') + '|';
      if (n > 60) bar += '>';  // beyond 3x the ideal
      std::printf("  rank %3zu %5.2f %s\n", r, x, bar.c_str());
    }
  }
  return 0;
}

/// --decode: the decode step over P' = 1, 2, 4, ..., P ranks.
int run_decode(const Args& a, const plan::Hardware& hw) {
  std::printf(
      "decode: cache %lld tokens per sequence (round-robin), batch %d, %d row(s), heads %d "
      "(kv %d), D = %d, %s\n",
      (long long)a.n, a.batch, a.rows, a.heads, a.kv_heads, a.dim, a.dtype_name.c_str());
  std::printf(
      "hardware: %s, memory %.3g B/s, F = %.3g FLOP/s, B = %.3g B/s, latency %.3g s, step "
      "overhead %.3g s\n",
      hw.name.c_str(), hw.memory_bandwidth, hw.flops, hw.bandwidth, hw.latency, hw.step_overhead);
  if (hw.ranks_per_node > 0)
    std::printf("          %d ranks per node: B = %.3g B/s, latency %.3g s inside a node\n",
                hw.ranks_per_node, hw.intra_bandwidth, hw.intra_latency);
  if (hw.latency == 0 || (hw.ranks_per_node > 0 && hw.intra_latency == 0))
    std::printf(
        "          (message latency 0: the presets carry bandwidths only; pass --latency and "
        "--intra-latency for your network)\n");
  std::printf("\n%7s %12s %12s %11s %11s %11s %11s %9s %12s\n", "P", "shard/rank", "read ms",
              "tree ms", "ring ms", "total tree", "total ring", "ring/tree", "tokens/s");
  std::vector<int> ps;
  for (int p = 1; p < a.p; p *= 2) ps.push_back(p);
  ps.push_back(a.p);
  for (int p : ps) {
    plan::DecodeProblem pb;
    pb.cache = a.n;
    pb.P = p;
    pb.batch = a.batch;
    pb.rows = a.rows;
    pb.heads = a.heads;
    pb.kv_heads = a.kv_heads;
    pb.dim = a.dim;
    pb.dtype_bytes = a.dtype;
    pb.compute_bytes = a.dtype < 4 ? 4 : a.dtype;
    const plan::DecodePrediction d = plan::predict_decode(hw, pb);
    std::printf("%7d %12s %12.4f %11.4f %11.4f %11.4f %11.4f %9.2f %12.1f\n", p,
                human(d.shard_bytes).c_str(), d.local_s * 1e3, d.tree_s * 1e3, d.ring_s * 1e3,
                d.tree_total() * 1e3, d.ring_total() * 1e3,
                d.tree_total() > 0 ? d.ring_total() / d.tree_total() : 1.0,
                d.tree_total() > 0 ? a.batch / d.tree_total() : 0.0);
  }
  return 0;
}

template <class Mask>
int run(const Args& a, const Mask& mask) {
  plan::Hardware hw;
  bool gpu_like = true;
  if (a.hw == "a100-nvlink")
    hw = plan::a100_nvlink();
  else if (a.hw == "a100-ib")
    hw = plan::a100_infiniband();
  else if (a.hw == "tpu-v3")
    hw = plan::tpu_v3();
  else if (a.hw == "tpu-v4")
    hw = plan::tpu_v4();
  else if (a.hw == "tpu-v5e")
    hw = plan::tpu_v5e();
  else if (a.hw == "h100-cluster")
    hw = plan::h100_cluster();
  else if (a.hw == "calibrate") {
    gpu_like = false;
    const int n = int(std::min<index_type>(a.n / a.p, 4096));
    const bool backward = a.pass != plan::Pass::forward;
    const auto c = a.dtype == 8 ? plan::calibrate<double>(n, 1, a.dim, 3, {}, backward)
                                : plan::calibrate<float>(n, 1, a.dim, 3, {}, backward);
    hw = plan::calibrated_hardware(c, memcpy_bandwidth(std::size_t(64) << 20), 0.0);
    std::printf(
        "calibration: tile kernel %.1f GFLOP/s on full tiles, partial tile %.2f x a full "
        "one (n = %d, D = %d, %s, %d thread(s)); memcpy %.1f GB/s\n",
        c.flops / 1e9, c.partial_tile_cost, n, a.dim, a.dtype == 8 ? "fp64" : "fp32",
        Kokkos::DefaultExecutionSpace().concurrency(), hw.bandwidth / 1e9);
    if (backward)
      std::printf(
          "calibration: backward %.1f GFLOP/s on full tiles (10 D FLOPs per pair), partial "
          "tile %.2f x a full one\n",
          c.backward_flops / 1e9, c.backward_partial_tile_cost);
  }
  if (a.flops > 0) hw.flops = a.flops;
  if (a.backward_flops > 0) hw.backward_flops = a.backward_flops;
  if (a.bandwidth >= 0) hw.bandwidth = a.bandwidth;
  if (a.latency >= 0) hw.latency = a.latency;
  if (a.memory >= 0) hw.memory_bytes = a.memory;
  if (a.ranks_per_node >= 0) hw.ranks_per_node = a.ranks_per_node;
  if (a.intra_bandwidth >= 0) hw.intra_bandwidth = a.intra_bandwidth;
  if (a.intra_latency >= 0) hw.intra_latency = a.intra_latency;
  if (a.hw == "calibrate") hw.memory_bandwidth = 2 * memcpy_bandwidth(std::size_t(64) << 20);
  if (a.memory_bandwidth > 0) hw.memory_bandwidth = a.memory_bandwidth;
  if (a.decode) return run_decode(a, hw);

  plan::Problem pb =
      gpu_like ? plan::problem_for<float, Kokkos::DefaultExecutionSpace,
                                   DefaultTileShape<float, false>, BackwardTileShape<float, false>>(
                     a.n, a.p, a.batch, a.heads, a.kv_heads, a.dim)
               : plan::problem_for<float, Kokkos::DefaultHostExecutionSpace>(
                     a.n, a.p, a.batch, a.heads, a.kv_heads, a.dim);
  pb.dtype_bytes = a.dtype;
  pb.compute_bytes = a.dtype < 4 ? 4 : a.dtype;  // bf16 / fp16 compute (and merge) in fp32
  if (a.block_q > 0) {
    pb.block_q = a.block_q;
    pb.block_k = a.block_k;
  }
  pb.pass = a.pass;
  if (a.balance >= 0) return run_balance(a, pb, hw);
  // The per-step outputs hold P x steps numbers per candidate (steps <= P).
  const double table = double(a.p) * double(a.p);
  if (a.steps && table > 1e5)
    usage("--steps prints P x steps numbers per candidate, at most 100000: P <= 316, got " +
          std::to_string(a.p));
  if (!a.data.empty() && table > 1e7)
    usage("--data writes P x steps numbers per candidate, at most 10000000: P <= 3162, got " +
          std::to_string(a.p));
  const bool pairs = !a.data.empty();
  const auto all = plan::compare(pb, mask, hw, pairs, a.steps || pairs);
  const int best = plan::recommend(all);

  std::printf(
      "problem: N = %lld, P = %d, batch %d, heads %d (kv %d), D = %d, %s, mask %s, "
      "tiles %dx%d",
      (long long)a.n, a.p, a.batch, a.heads, a.kv_heads, a.dim, a.dtype_name.c_str(),
      a.mask.c_str(), pb.block_q, pb.block_k);
  if (a.pass != plan::Pass::forward)
    std::printf(" (backward %dx%d), %s", pb.backward_block_q(), pb.backward_block_k(),
                plan::pass_name(a.pass));
  std::printf("\n");
  std::printf(
      "hardware: %s, F = %.3g FLOP/s, partial tile %.2f, B = %.3g B/s, latency %.3g s, "
      "memory %s per rank\n",
      hw.name.c_str(), hw.flops, hw.partial_tile_cost, hw.bandwidth, hw.latency,
      hw.memory_bytes > 0 ? human(hw.memory_bytes).c_str() : "unlimited");
  if (a.pass != plan::Pass::forward)
    std::printf("          backward F = %.3g FLOP/s (10 D FLOPs per pair), partial tile %.2f\n",
                hw.backward_rate(), hw.backward_partial_cost());
  if (hw.ranks_per_node > 0)
    std::printf("          %d ranks per node: B = %.3g B/s, latency %.3g s inside a node\n",
                hw.ranks_per_node, hw.intra_bandwidth, hw.intra_latency);
  std::printf(
      "Ring Attention (arXiv:2310.01889): overlap needs c >= %.0f tokens per rank (c = N/P = "
      "%lld)\n\n",
      plan::overlap_block_size(hw, a.dtype, a.heads, a.kv_heads), (long long)(a.n / a.p));
  // Two link levels: also the bytes a rank sends to other nodes (the slow links).
  const bool two_levels = hw.ranks_per_node > 0;
  std::printf("%-11s %-16s %12s %8s %8s %6s %9s %12s", "partition", "schedule", "makespan",
              "vs ring", "vs 1 dev", "idle", "idle(t)", "sent/rank");
  if (two_levels) std::printf(" %12s", "net/rank");
  std::printf(" %12s %5s\n", "peak/rank", "fits");
  for (const auto& x : all) {
    if (!x.valid) {
      std::printf("%-11s %-16s   not possible: %s\n", x.partition.c_str(), x.schedule.c_str(),
                  x.why_not.c_str());
      continue;
    }
    std::printf("%-11s %-16s %10.3f ms %7.2fx %7.2fx %6.3f %9.3f %12s", x.partition.c_str(),
                x.schedule.c_str(), x.makespan_s * 1e3, x.speedup_over_ring(),
                x.speedup_over_single(), x.idle_step_fraction(),
                std::max(0.0, x.idle_time_fraction()), human(double(x.max_bytes_sent())).c_str());
    if (two_levels) std::printf(" %12s", human(double(x.max_network_bytes_sent())).c_str());
    std::printf(" %12s %5s\n", human(double(x.peak_bytes())).c_str(), x.fits ? "yes" : "no");
  }
  if (best >= 0)
    std::printf("\nrecommended: %s partition + %s schedule (%.2fx the contiguous ring)\n",
                all[std::size_t(best)].partition.c_str(), all[std::size_t(best)].schedule.c_str(),
                all[std::size_t(best)].speedup_over_ring());
  else
    std::printf("\nrecommended: none fits in %s per rank\n", human(hw.memory_bytes).c_str());

  if (a.steps)
    for (const auto& x : all) {
      if (!x.valid) continue;
      std::printf("\n%s + %s: per rank, per step: compute ms / link ms [q block, k block]\n",
                  x.partition.c_str(), x.schedule.c_str());
      for (std::size_t r = 0; r < x.ranks.size(); ++r) {
        std::printf("  rank %2zu:", r);
        for (const auto& s : x.ranks[r].steps)
          std::printf(" %7.3f/%6.3f [%d,%d]", s.compute_s * 1e3, s.comm_s * 1e3, s.task.q_rank,
                      s.task.k_rank);
        std::printf("\n");
      }
    }
  if (a.json)
    for (const auto& x : all)
      if (x.valid)
        std::printf(
            "{\"pass\":\"%s\",\"partition\":\"%s\",\"schedule\":\"%s\",\"makespan_s\":%.6g,"
            "\"speedup_over_ring\":%.4f,\"speedup_over_single\":%.4f,"
            "\"idle_step_fraction\":%.4f,\"bytes_sent_per_rank\":%lld,"
            "\"network_bytes_per_rank\":%lld,\"peak_bytes_per_rank\":%lld,\"fits\":%s}\n",
            plan::pass_name(a.pass), x.partition.c_str(), x.schedule.c_str(), x.makespan_s,
            x.speedup_over_ring(), x.speedup_over_single(), x.idle_step_fraction(),
            (long long)x.max_bytes_sent(), (long long)x.max_network_bytes_sent(),
            (long long)x.peak_bytes(), x.fits ? "true" : "false");
  if (!a.data.empty()) {
    // gnuplot data: one block per candidate (index i), rows "step rank work",
    // work in units of a full block of (N/P)^2 allowed pairs per (batch, head).
    FILE* f = std::fopen(a.data.c_str(), "w");
    if (!f) usage("--data: cannot write " + a.data);
    const double block = double(pb.local()) * double(pb.local());
    for (const auto& x : all) {
      if (!x.valid) continue;
      std::fprintf(f, "# %s + %s (makespan %.6g s)\n", x.partition.c_str(), x.schedule.c_str(),
                   x.makespan_s);
      for (std::size_t r = 0; r < x.ranks.size(); ++r)
        for (std::size_t s = 0; s < x.ranks[r].steps.size(); ++s)
          std::fprintf(f, "%zu %zu %.6f\n", s, r,
                       double(x.ranks[r].steps[s].tiles.allowed_pairs) / block);
      std::fprintf(f, "\n\n");
    }
    std::fclose(f);
    std::printf("\nwrote %s\n", a.data.c_str());
  }
  return best >= 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (blockattn_cli::wants_help(argc, argv)) {
    std::fputs(usage_text, stdout);
    return 0;
  }
  const Args a = parse(argc, argv);
  // Only calibration runs kernels: the plan itself is host arithmetic, so
  // Kokkos (and its OpenMP binding warnings) starts only for --hw calibrate.
  const bool kernels = a.hw == "calibrate";
  if (kernels) Kokkos::initialize(argc, argv);
  const int rc = blockattn_cli::run_guarded("blockattn_plan", true, [&] {
    if (a.mask == "full") return run(a, FullMask{});
    if (a.mask == "causal") return run(a, CausalMask{});
    return run(a, causal_window(a.window));  // window:W (parse checked it)
  });
  if (kernels) Kokkos::finalize();
  return rc;
}
