// SPDX-License-Identifier: Apache-2.0
// Serving example: a small causal transformer layer (random weights: token
// embedding, Q/K/V projections with GQA, attention, output projection with a
// residual, unembedding) generating tokens greedily for two sequences of
// different prompt lengths, with the KV cache sharded across the MPI ranks
// in pages (PagedKVCache: pages of 8 tokens taken as the sequences grow).
// The first prompt goes in by chunked prefill (prefill_attention); then each
// step is one mixed batch (batch_attention): the first sequence decodes while
// the second one's prompt arrives in chunks, then both decode (continuous
// batching). Every step's attention output is checked against
// the same model run on one rank (a SelfCommunicator and an unsharded,
// contiguous KVCache), and so are the generated tokens. --kv-cache fp8 or
// int8 stores both caches' rows as 8-bit codes with a scale per row
// (fp8_e4m3 or int8: half the bytes of bf16).
//
//   mpiexec -n 3 ./blockattn_serve [--steps S] [--chunk C] [--placement roundrobin|contiguous]
//                                  [--merge tree|ring] [--dtype fp32|bf16]
//                                  [--kv-cache values|fp8|int8]
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "../tools/cli_args.hpp"  // strict numbers, --help

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

constexpr int vocab = 97, model = 64, heads = 4, kv_heads = 2, hd = 16;

/// The layer's weights (the same seed on every rank).
struct Weights {
  std::vector<float> embed, wq, wk, wv, wo, unembed;
  explicit Weights(unsigned seed) {
    std::mt19937 rng(seed);
    auto init = [&](std::vector<float>& w, int rows, int cols) {
      std::normal_distribution<float> n(0.f, 1.f / std::sqrt(float(rows)));
      w.resize(std::size_t(rows) * cols);
      for (float& x : w) x = n(rng);
    };
    init(embed, vocab, model);
    for (float& x : embed) x *= std::sqrt(float(vocab));  // embeddings of unit size
    init(wq, model, heads * hd);
    init(wk, model, kv_heads * hd);
    init(wv, model, kv_heads * hd);
    init(wo, heads * hd, model);
    init(unembed, model, vocab);
  }
};

/// y (n x cols) = x (n x rows) w (rows x cols).
std::vector<float> matmul(const std::vector<float>& x, const std::vector<float>& w, int n, int rows,
                          int cols) {
  std::vector<float> y(std::size_t(n) * cols, 0.f);
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < rows; ++r) {
      const float a = x[std::size_t(i) * rows + r];
      for (int c = 0; c < cols; ++c)
        y[std::size_t(i) * cols + c] += a * w[std::size_t(r) * cols + c];
    }
  return y;
}

/// A (1, n, h, hd) device View of n rows of h heads (row-major host data).
template <class T>
Kokkos::View<T****, Mem> to_view(const std::vector<float>& x, int n, int h) {
  Kokkos::View<T****, Mem> v("x", 1, n, h, hd);
  auto m = Kokkos::create_mirror_view(v);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < h; ++j)
      for (int d = 0; d < hd; ++d) m(0, i, j, d) = T(x[(std::size_t(i) * h + j) * hd + d]);
  Kokkos::deep_copy(v, m);
  return v;
}

/// One model (its cache on `comm`): the next token after each sequence's
/// tokens, and the attention outputs of the last call (for the check).
template <class T, class Comm, class Cache>
struct Model {
  Comm comm;
  const Weights& w;
  Cache cache;
  blockattn::ServeOptions opts;
  std::vector<float> last_attention;  // every output row of the last call

  Model(const Comm& c, const Weights& weights, Cache&& kv, blockattn::MergeAlgorithm merge)
      : comm(c), w(weights), cache(std::move(kv)) {
    opts.merge = merge;
  }

  /// Projections of tokens: q (n x heads*hd), k and v (n x kv_heads*hd), x.
  void project(const std::vector<int>& tokens, std::vector<float>& x, std::vector<float>& q,
               std::vector<float>& k, std::vector<float>& v) const {
    const int n = int(tokens.size());
    x.assign(std::size_t(n) * model, 0.f);
    for (int i = 0; i < n; ++i)
      std::copy_n(&w.embed[std::size_t(tokens[std::size_t(i)]) * model], model,
                  &x[std::size_t(i) * model]);
    q = matmul(x, w.wq, n, model, heads * hd);
    k = matmul(x, w.wk, n, model, kv_heads * hd);
    v = matmul(x, w.wv, n, model, kv_heads * hd);
  }

  /// Greedy next token from attention output a (n x heads*hd) and residual x: the last row's.
  int next_token(const std::vector<float>& a, const std::vector<float>& x, int row) const {
    std::vector<float> r(std::size_t(heads) * hd);
    for (std::size_t c = 0; c < r.size(); ++c) r[c] = a[std::size_t(row) * r.size() + c];
    std::vector<float> h = matmul(r, w.wo, 1, heads * hd, model);
    for (int c = 0; c < model; ++c) h[std::size_t(c)] += x[std::size_t(row) * model + c];
    const std::vector<float> logits = matmul(h, w.unembed, 1, model, vocab);
    int best = 0;
    for (int c = 1; c < vocab; ++c)
      if (logits[std::size_t(c)] > logits[std::size_t(best)]) best = c;
    return best;
  }

  /// Prefill of sequence `seq` with `tokens` in chunks; returns the next token.
  int prefill(int seq, const std::vector<int>& tokens, int chunk) {
    int next = -1;
    last_attention.clear();
    for (std::size_t t0 = 0; t0 < tokens.size(); t0 += std::size_t(chunk)) {
      const std::vector<int> part(
          tokens.begin() + std::ptrdiff_t(t0),
          tokens.begin() + std::ptrdiff_t(std::min(tokens.size(), t0 + std::size_t(chunk))));
      const int n = int(part.size());
      std::vector<float> x, q, k, v;
      project(part, x, q, k, v);
      Kokkos::View<T****, Mem> o("o", 1, n, heads, hd);
      Kokkos::View<blockattn::compute_t<T>***, Mem> lse("lse", 1, heads, n);
      blockattn::prefill_attention(comm, Exec{}, cache, seq, to_view<T>(q, n, heads),
                                   to_view<T>(k, n, kv_heads), to_view<T>(v, n, kv_heads), o, lse,
                                   blockattn::CausalMask{}, opts);
      const std::vector<float> a = gather(o, n);
      for (float y : a) last_attention.push_back(y);
      next = next_token(a, x, n - 1);
    }
    return next;
  }

  /// One serving step (batch_attention): sequence seqs[i] brings tokens[i]
  /// (one: its newest token, decoding; more: a chunk of its prompt), all in
  /// one call; returns each sequence's next token (of its last row).
  std::vector<int> step(const std::vector<int>& seqs, const std::vector<std::vector<int>>& tokens) {
    blockattn::ServeBatch batch{seqs, {}};
    std::vector<int> all;
    for (const auto& t : tokens) {
      batch.rows.push_back(int(t.size()));
      all.insert(all.end(), t.begin(), t.end());
    }
    const int n = int(all.size());
    std::vector<float> x, q, k, v;
    project(all, x, q, k, v);
    Kokkos::View<T****, Mem> o("o", 1, n, heads, hd);
    Kokkos::View<blockattn::compute_t<T>***, Mem> lse("lse", 1, heads, n);
    // Collective: the appends and the rows of every sequence; a full pool on
    // one rank throws on every rank, nothing appended.
    blockattn::batch_attention(comm, Exec{}, cache, batch, to_view<T>(q, n, heads),
                               to_view<T>(k, n, kv_heads), to_view<T>(v, n, kv_heads), o, lse,
                               blockattn::CausalMask{}, opts);
    last_attention = gather(o, n);
    std::vector<int> next;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      next.push_back(next_token(last_attention, x, int(batch.offset(i + 1)) - 1));
    return next;
  }

  /// Rows of o (n rows of a (1, n, ...) or (n, 1, ...) View) as n x heads*hd floats.
  static std::vector<float> gather(const Kokkos::View<T****, Mem>& o, int n) {
    auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
    std::vector<float> a(std::size_t(n) * heads * hd);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < heads; ++j)
        for (int d = 0; d < hd; ++d)
          a[(std::size_t(i) * heads + j) * hd + d] =
              float(o.extent(0) == 1 ? m(0, i, j, d) : m(i, 0, j, d));
    return a;
  }
};

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = a.size() == b.size() ? 0.0 : 1e30;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

struct Args {
  int steps = 24, chunk = 16;
  std::string placement = "roundrobin", merge = "tree", dtype = "fp32", kv = "values";
};

template <class T, class S, class Placement>
int run(const Args& args, const Placement& placement, blockattn::index_type per_rank_capacity) {
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  const int rank = comm.rank(), P = comm.size();
  const Weights w(2024);
  const auto merge =
      args.merge == "tree" ? blockattn::MergeAlgorithm::tree : blockattn::MergeAlgorithm::ring;
  const std::vector<std::vector<int>> prompts = {
      {3,  14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38,         32,
       79, 50, 28, 84, 19, 71, 69, 39, 37, 51, 5,  82, 0,  97 % vocab, 49,
       44, 59, 23, 7,  81, 64, 6,  28, 62, 8,  62, 8,  3},
      {27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74, 71, 35, 26, 62, 49, 77, 57}};
  const int B = int(prompts.size());
  // This rank's pages: enough for its share of both sequences, 8 tokens a page.
  constexpr int page = 8;
  const int pages = B * int((per_rank_capacity + page - 1) / page);
  using Paged = blockattn::PagedKVCache<T, Exec, Placement, S>;
  Model<T, blockattn::MpiCommunicator<>, Paged> sharded(
      comm, w, Paged(comm, B, pages, page, kv_heads, hd, placement, per_rank_capacity * P), merge);
  // The same model on one rank: an unsharded, contiguous cache of the whole capacity.
  const blockattn::index_type whole = per_rank_capacity * P;
  using Flat = blockattn::KVCache<T, Exec, blockattn::RoundRobinPlacement, S>;
  blockattn::SelfCommunicator self;
  Model<T, blockattn::SelfCommunicator, Flat> single(
      self, w, Flat(self, B, whole, kv_heads, hd, blockattn::RoundRobinPlacement{1}), merge);
  const double tol = std::is_same<T, float>::value ? 1e-4 : 2e-2;
  double worst = 0.0;
  bool same_tokens = true;
  // Sequence 0's prompt alone, in chunks (prefill_attention); then every
  // step is one batch_attention: sequence 0 decodes while sequence 1's
  // prompt arrives chunk by chunk (continuous batching), then both decode.
  std::vector<int> newest(static_cast<std::size_t>(B));
  std::vector<std::vector<int>> generated(static_cast<std::size_t>(B));
  {
    const int a = sharded.prefill(0, prompts[0], args.chunk);
    const int s = single.prefill(0, prompts[0], args.chunk);
    worst = std::max(worst, max_diff(sharded.last_attention, single.last_attention));
    same_tokens = same_tokens && a == s;
    newest[0] = a;
  }
  std::size_t prompt1 = 0;  // sequence 1's prompt tokens in the cache
  int mixed = 0;            // steps that mixed a prefill chunk with a decode row
  for (int step = 0; step < args.steps; ++step) {
    std::vector<int> seqs = {0, 1};
    std::vector<std::vector<int>> tokens = {{newest[0]}, {}};
    const bool prefilling = prompt1 < prompts[1].size();
    if (prefilling) {
      const std::size_t end = std::min(prompts[1].size(), prompt1 + std::size_t(args.chunk));
      tokens[1].assign(prompts[1].begin() + std::ptrdiff_t(prompt1),
                       prompts[1].begin() + std::ptrdiff_t(end));
      prompt1 = end;
      ++mixed;
    } else {
      tokens[1] = {newest[1]};
    }
    const std::vector<int> a = sharded.step(seqs, tokens);
    const std::vector<int> s = single.step(seqs, tokens);
    worst = std::max(worst, max_diff(sharded.last_attention, single.last_attention));
    same_tokens = same_tokens && a == s;
    generated[0].push_back(newest[0]);
    if (!prefilling) generated[1].push_back(newest[1]);
    newest[0] = a[0];
    if (prompt1 == prompts[1].size()) newest[1] = a[1];  // the prompt's last row's or decoded
  }
  const bool ok = worst <= tol && same_tokens;
  if (rank == 0) {
    std::printf(
        "serve: %d ranks, %s, %s merge, %s, paged cache (pages of %d, %s); prompts of %zu and "
        "%zu tokens, chunk %d, %d steps (%d mixing a prefill chunk with a decode row)\n",
        P, args.placement.c_str(), args.merge.c_str(), args.dtype.c_str(), page,
        args.kv == "values" ? args.dtype.c_str() : args.kv.c_str(), prompts[0].size(),
        prompts[1].size(), args.chunk, args.steps, mixed);
    for (int b = 0; b < B; ++b) {
      std::printf("  sequence %d: cache %lld tokens (%d on rank 0, %d pages); generated", b,
                  (long long)sharded.cache.length(b), sharded.cache.local_length(b),
                  sharded.cache.pages_of(b));
      for (int t : generated[std::size_t(b)]) std::printf(" %d", t);
      std::printf("\n");
    }
    std::printf(
        "  vs one rank: max |attention output difference| %.3g (tolerance %.1g), "
        "tokens %s: %s\n",
        worst, tol, same_tokens ? "identical" : "DIFFER", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}

/// run<T, S> for the value type and cache storage of the command line.
template <class Placement>
int dispatch(const Args& a, const Placement& p, blockattn::index_type cap) {
  using blockattn::bf16;
  using blockattn::fp8_e4m3;
  if (a.dtype == "fp32")
    return a.kv == "fp8"    ? run<float, fp8_e4m3>(a, p, cap)
           : a.kv == "int8" ? run<float, std::int8_t>(a, p, cap)
                            : run<float, float>(a, p, cap);
  return a.kv == "fp8"    ? run<bf16, fp8_e4m3>(a, p, cap)
         : a.kv == "int8" ? run<bf16, std::int8_t>(a, p, cap)
                          : run<bf16, bf16>(a, p, cap);
}

const char* const usage_text = R"(usage: mpiexec -n P blockattn_serve [flags]
A small causal transformer layer generating tokens for two sequences with its
KV cache sharded over the ranks in pages (chunked prefill, then mixed steps:
one sequence decoding while the other's prompt arrives in chunks), checked at
every step against the same model on one rank.
  --steps S        serving steps after the first prompt [24]
  --chunk C        prefill chunk [16]
  --placement X    roundrobin|contiguous [roundrobin]
  --merge M        tree|ring [tree]
  --dtype T        fp32|bf16 [fp32]
  --kv-cache K     values|fp8|int8: the caches' rows as the values, or as
                   fp8_e4m3 / int8 codes with a scale per row [values]
  --help, -h       this text
Exit status 1: a result differs from the one-rank run; 2: a bad command line.
)";

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (blockattn_cli::wants_help(argc, argv)) {
    if (rank == 0) std::fputs(usage_text, stdout);
    MPI_Finalize();
    return 0;
  }
  Kokkos::initialize(argc, argv);
  const int rc = blockattn_cli::run_guarded("blockattn_serve", rank == 0, [&] {
    Args a;
    std::string error;
    for (int i = 1; i < argc && error.empty(); ++i) {
      const std::string f = argv[i];
      if (f != "--steps" && f != "--chunk" && f != "--placement" && f != "--merge" &&
          f != "--dtype" && f != "--kv-cache")
        error = "unknown argument " + f + " (blockattn_serve --help lists the flags)";
      else if (i + 1 >= argc)
        error = f + " needs a value";
      else if (f == "--steps")
        error = blockattn_cli::read_int(f, argv[++i], a.steps, 0, 4096);
      else if (f == "--chunk")
        error = blockattn_cli::read_int(f, argv[++i], a.chunk, 1, 4096);
      else {
        const std::string v = argv[++i];
        const bool valid = (f == "--placement" && (v == "roundrobin" || v == "contiguous")) ||
                           (f == "--merge" && (v == "tree" || v == "ring")) ||
                           (f == "--dtype" && (v == "fp32" || v == "bf16")) ||
                           (f == "--kv-cache" && (v == "values" || v == "fp8" || v == "int8"));
        if (!valid) error = f + ": unknown value '" + v + "' (see --help)";
        (f == "--placement" ? a.placement
         : f == "--merge"   ? a.merge
         : f == "--dtype"   ? a.dtype
                            : a.kv) = v;
      }
    }
    if (!error.empty()) {
      if (rank == 0) std::fprintf(stderr, "blockattn_serve: %s\n", error.c_str());
      return 2;
    }
    const blockattn::index_type longest = 43 + a.steps;  // the longer prompt + generated tokens
    if (a.placement == "roundrobin") {
      const blockattn::RoundRobinPlacement p{2};
      const auto cap = p.local_capacity(longest, size);
      return dispatch(a, p, cap);
    }
    const blockattn::ContiguousPlacement p{(longest + size - 1) / size};
    return dispatch(a, p, p.tokens_per_rank);
  });
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
