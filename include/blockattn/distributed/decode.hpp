// SPDX-License-Identifier: Apache-2.0
// Serving over ranks: decode and chunked prefill against a KVCache sharded
// across the communicator's ranks. Each rank attends its shard (split-KV
// inside, kernel/decode.hpp), then the partial results merge over the ranks
// (tree or ring: distributed/impl/merge_ranks.hpp; the same bits on every
// rank). ServeOptions: distributed/options.hpp.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/impl/cache_access.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/invariant_serve.hpp>
#include <blockattn/distributed/impl/merge_ranks.hpp>
#include <blockattn/distributed/impl/sinks.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/kv_cache.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/distributed/paged_kv_cache.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/decode.hpp>
#include <blockattn/policy/mask.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

namespace impl {

/// Whether the cache shard's key positions map(0 .. L) are map(0) + j * stride:
/// then the kernels run them as AffinePositions, else from a table.
template <class Map>
bool affine_positions(const Map& map, index_type L, index_type& first, index_type& stride) {
  first = L > 0 ? map(0) : 0;
  stride = L > 1 ? map(1) - first : 1;
  for (index_type j = 2; j < L; ++j)
    if (map(j) != first + j * stride) return false;
  return stride >= 1;
}

/// Whether a prefill chunk of N rows (H heads, head dim D) runs on the
/// forward's kernels: N >= opts.prefill_forward_rows (-1: 12, or 24 where
/// bf16 decode runs AVX512-BF16 dot products) and, on host spaces,
/// query tiles (split down to the kernel's row granule) for at least half
/// of the threads (the split-KV decode kernel keeps every thread busy
/// whatever N is; on a 2-core Zen 4 the forward's kernels ran 1.1-1.4x its
/// rate at 16 rows and 1.6-4x from 64 rows up).
template <class T, class ExecSpace>
bool prefill_on_forward_pays(const ExecSpace& exec, const ServeOptions& opts, int N, int H, int D) {
  const int rows = opts.prefill_forward_rows >= 0 ? opts.prefill_forward_rows
                   : decode_uses_bf16_dot<ExecSpace, T>(opts.host_matrix) ? 24
                                                                          : 12;
  if (N < rows) return false;
  if constexpr (is_host_space_v<ExecSpace>) {
    using CT = compute_t<T>;
    const int granule = forward_uses_matrix<CT, T, ExecSpace>(D, opts.host_matrix)
                            ? matrix_query_rows
                            : forward_layout<CT, ExecSpace>(D).micro_rows;
    const long tiles = long(H) * ((N + granule - 1) / granule);
    return 2 * tiles >= long(exec.concurrency());
  } else {
    return true;
  }
}

/// One prefill chunk on attention_forward's kernels: the chunk's rows q (1,
/// N, H, D) at positions [length - N, length) of sequence `s` against this
/// rank's L cached keys of it at cache.positions()(j), into o, lse (the
/// partial result of this rank's shard, or the result when the shard is the
/// whole sequence). Fences `exec` (the position table is the call's).
template <class ExecSpace, class Cache, class QV, class OV, class LV, class Mask>
void prefill_on_forward(const ExecSpace& exec, const char* fn, const Cache& cache, int s,
                        const QV& q, const OV& o, const LV& lse, const Mask& mask,
                        const ServeOptions& opts, const SinkLogits& sinks) {
  using CT = compute_t<typename Cache::value_type>;
  using mem = typename ExecSpace::memory_space;
  const index_type L = cache.local_length(s), N = index_type(q.extent(1));
  const index_type q0 = cache.length(s) - N;
  const auto kv = shard_rows(exec, cache, s, L);  // a paged cache's pages gathered
  const auto& k = kv.first;
  const auto& v = kv.second;
  ForwardOptions fo;
  fo.host_matrix = opts.host_matrix;
  fo.sinks = sinks;
  const BlockExtents e = validate_forward<ExecSpace>(fn, q, k, v, o, lse, opts.scale, true);
  check_score_and_sinks(fn, mask, fo, e.heads, false);
  const CT scale = softmax_scale<CT>(opts.scale, e.dim);
  const auto map = cache.positions();
  index_type first = 0, stride = 1;
  if (affine_positions(map, L, first, stride)) {
    const AffinePositions qpos{index_type(1) << 62, q0, 0, 1},
        kpos{index_type(1) << 62, first, 0, stride};
    forward_on_positions(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, fo);
    return;
  }
  // Positions from a table: the chunk's N rows, then the shard's L keys.
  Kokkos::View<index_type*, mem> table("blockattn::prefill_positions", std::size_t(N + L));
  auto host = Kokkos::create_mirror_view(table);
  for (index_type i = 0; i < N; ++i) host(i) = q0 + i;
  for (index_type j = 0; j < L; ++j) host(N + j) = map(j);
  Kokkos::deep_copy(exec, table, host);
  const TablePositions qpos{host.data(), table.data()}, kpos{host.data() + N, table.data() + N};
  forward_on_positions(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, fo);
  exec.fence();  // the kernels have read the table
}

/// Whether `cache` is this communicator's rank's: empty, or the error.
template <class C, class Cache>
std::string cache_rank_error(C& comm, const char* fn, const Cache& cache) {
  if (comm.rank() == cache.rank() && comm.size() == cache.size()) return {};
  return std::string("blockattn::") + fn + ": the cache is rank " + std::to_string(cache.rank()) +
         " of " + std::to_string(cache.size()) + ", the communicator rank " +
         std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
         "; expected the cache of this communicator's rank";
}

/// This rank's checks of a serving call on `cache` (the library's own
/// checks run in the kernel calls, after the ranks agree): the
/// communicator, q (B sequences, rows, heads, head_dim) and opts. Returns
/// the error, empty if none.
template <class C, class Cache, class QV>
std::string serve_call_error(C& comm, const char* fn, const Cache& cache, int B, const QV& q,
                             const ServeOptions& opts) {
  std::string error = cache_rank_error(comm, fn, cache);
  const int N = int(q.extent(1)), H = int(q.extent(2));
  const char* names[4] = {"sequences", "rows", "heads", "head_dim"};
  const std::size_t want[4] = {std::size_t(B), q.extent(1), q.extent(2), std::size_t(cache.dim())};
  for (int d = 0; d < 4 && error.empty(); ++d)
    if ((d == 0 || d == 3) && q.extent(d) != want[d])
      error = std::string("blockattn::") + fn + ": argument 'q' has extent(" + std::to_string(d) +
              ") (" + names[d] + ") = " + std::to_string(q.extent(d)) + ", expected " +
              std::to_string(want[d]);
  if (error.empty() && (N < 1 || H < 1 || H % cache.kv_heads() != 0))
    error = std::string("blockattn::") + fn + ": argument 'q' has " + std::to_string(N) +
            " rows and " + std::to_string(H) + " heads; expected >= 1 rows and a multiple of " +
            "the cache's " + std::to_string(cache.kv_heads()) + " kv heads";
  if (error.empty() && opts.prefill_forward_rows < -1)
    error = std::string("blockattn::") + fn + ": argument 'opts.prefill_forward_rows' is " +
            std::to_string(opts.prefill_forward_rows) + ", expected -1 (automatic) or >= 0";
  return error;
}

/// The checks of o, lse and the sinks against q's rows and heads: reported
/// once the ranks agree on q's (reach_consensus' `relative`), so that a q
/// with the wrong rows on one rank is named, not the o that matches the
/// others.
template <class QV, class OV, class LV>
std::string serve_output_error(const char* fn, const QV& q, const OV& o, const LV& lse,
                               const ServeOptions& opts) {
  const char* names[4] = {"sequences", "rows", "heads", "head_dim"};
  std::string relative;
  for (int d = 0; d < 4 && relative.empty(); ++d)
    if (o.extent(d) != q.extent(d))
      relative = std::string("blockattn::") + fn + ": argument 'o' has extent(" +
                 std::to_string(d) + ") (" + names[d] + ") = " + std::to_string(o.extent(d)) +
                 ", expected q's " + std::to_string(q.extent(d));
  const std::size_t lse_want[3] = {q.extent(0), q.extent(2), q.extent(1)};
  for (int d = 0; d < 3 && relative.empty(); ++d)
    if (lse.extent(d) != lse_want[d])
      relative = std::string("blockattn::") + fn + ": argument 'lse' has extent(" +
                 std::to_string(d) + ") = " + std::to_string(lse.extent(d)) + ", expected " +
                 std::to_string(lse_want[d]) + " (lse is (sequences, heads, rows))";
  if (relative.empty() && opts.sinks.data() != nullptr && opts.sinks.extent(0) != q.extent(2))
    relative = std::string("blockattn::") + fn +
               ": argument 'opts.sinks' has extent(0) = " + std::to_string(opts.sinks.extent(0)) +
               ", expected one sink logit per query head (" + std::to_string(q.extent(2)) + ")";
  return relative;
}

/// What the ranks of a serving call compare: the call, the cache and the
/// options (the caller adds its sequences and their lengths).
template <class ExecSpace, class Cache, class Mask>
Fingerprint serve_fingerprint(const char* fn, const Cache& cache, int H, int D, const Mask& mask,
                              const ServeOptions& opts, bool prefill) {
  using T = typename Cache::value_type;
  Fingerprint f;
  f.text("call", fn)
      .text("value type", type_name<T>())
      .number("heads (q.extent(2))", H)
      .number("kv heads", cache.kv_heads())
      .number("head_dim", D)
      .text("merge", merge_name(opts.merge))
      .number("splits", opts.splits)
      .real("scale", opts.scale, to_text(opts.scale))
      .text("placement", type_name<typename Cache::placement_type>())
      .number("page size (0: contiguous)", cache_page_size(cache))
      .text("stored as", cache_storage_name<Cache>());
  const auto pp = cache.placement().parameters();
  for (std::size_t i = 0; i < pp.size(); ++i)
    f.number("placement parameter " + std::to_string(i), pp[i]);
  if (prefill) {
    f.number("prefill forward rows", opts.prefill_forward_rows);
    f.number("host matrix", int(opts.host_matrix));
  }
  f.number("invariant", opts.invariant ? 1 : 0).number("invariant tile", opts.invariant_tile);
  f.text("sinks", sink_text<ExecSpace>(opts.sinks));
  add_mask(f, mask);
  return f;
}

/// This rank's part of sequences [s0, s1): their last q.extent(1) tokens'
/// queries q against the rank's shard, into out, out_lse (the rank's
/// partial, or the result when P = 1). A prefill chunk (`prefill`, one
/// sequence) of many rows runs on the forward's kernels, everything else on
/// the split-KV decode kernel (`seq_splits`: each sequence's key ranges,
/// DecodeOptions::sequence_splits). The same work for the same sequence,
/// rows, shard and ranges whatever else the call attends.
template <class ExecSpace, class Cache, class QV, class OV, class LV, class Mask>
void attend_shard(const ExecSpace& exec, const char* fn, const Cache& cache, int s0, int s1,
                  const QV& q, const OV& out, const LV& out_lse, const Mask& mask,
                  const ServeOptions& opts, const SinkLogits& sinks, bool prefill,
                  const Kokkos::View<const int*, Kokkos::AnonymousSpace>& seq_splits = {}) {
  using T = typename Cache::value_type;
  using mem = typename ExecSpace::memory_space;
  const int B = s1 - s0;
  const int N = int(q.extent(1)), H = int(q.extent(2)), D = int(q.extent(3));
  if (prefill && B == 1 && prefill_on_forward_pays<T>(exec, opts, N, H, D)) {
    prefill_on_forward(exec, fn, cache, s0, q, out, out_lse, mask, opts, sinks);
    return;
  }
  Kokkos::View<index_type*, mem> qpos("blockattn::q_positions", B);
  auto qh = Kokkos::create_mirror_view(qpos);
  int max_local = 0;
  for (int s = s0; s < s1; ++s) {
    qh(s - s0) = cache.length(s) - N;
    max_local = std::max(max_local, cache.local_length(s));
  }
  Kokkos::deep_copy(qpos, qh);
  const auto len = Kokkos::subview(cache.local_lengths(), Kokkos::make_pair(s0, s1));
  DecodeOptions dopts;
  dopts.scale = opts.scale;
  dopts.splits = opts.splits;
  dopts.max_length = max_local;
  dopts.host_matrix = opts.host_matrix;
  dopts.sinks = sinks;
  dopts.sequence_splits = seq_splits;
  cache_decode(exec, cache, s0, s1, q, len, qpos, out, out_lse, mask, dopts);
}

/// The common part of decode_attention and prefill_attention: sequences
/// [s0, s1) of the cache, their last q.extent(1) tokens as queries.
template <class C, class ExecSpace, class Cache, class QV, class OV, class LV, class Mask>
void attend_cache(C& comm, const ExecSpace& exec, const char* fn, const Cache& cache, int s0,
                  int s1, const QV& q, const OV& o, const LV& lse, const Mask& mask,
                  const ServeOptions& opts, std::string error, index_type appending = 0,
                  const std::function<void()>& after_consensus = {}, bool prefill = false) {
  using T = typename Cache::value_type;
  using CT = compute_t<T>;
  using mem = typename ExecSpace::memory_space;
  const int B = s1 - s0;
  const int N = int(q.extent(1)), H = int(q.extent(2)), D = int(q.extent(3));
  if (error.empty()) error = serve_call_error(comm, fn, cache, B, q, opts);
  const std::string relative = serve_output_error(fn, q, o, lse, opts);
  // `appending` tokens go into each sequence after the consensus (prefill).
  for (int s = s0; s < s1 && error.empty(); ++s)
    if (cache.length(s) + appending < N)
      error = std::string("blockattn::") + fn + ": sequence " + std::to_string(s) + " holds " +
              std::to_string(cache.length(s) + appending) + " tokens; the " + std::to_string(N) +
              " query rows are its last tokens: append their keys and values first";
  if (error.empty() && opts.invariant)
    error = invariant_cache_error(fn, cache, s0, s1, appending, opts.invariant_tile);
  if (opts.check_config) {
    Fingerprint f = serve_fingerprint<ExecSpace>(fn, cache, H, D, mask, opts, prefill);
    f.number("sequences", B).number("first sequence", s0).number("rows (q.extent(1))", N);
    std::uint64_t h = 1469598103934665603ull;
    for (int s = s0; s < s1; ++s) {
      h ^= std::uint64_t(cache.length(s));
      h *= 1099511628211ull;
    }
    f.number("sequence lengths (hash)", std::int64_t(h));
    f.number("tokens appended", appending);
    reach_consensus(comm, fn, error, f, 0, nullptr, relative);
  } else if (!error.empty() || !relative.empty()) {
    throw invalid_argument(error.empty() ? relative : error);
  }
  if (after_consensus) after_consensus();  // every rank agreed: the prefill's append
  if (opts.invariant) {
    invariant_attend(comm, exec, cache, s0, s1, q, o, lse, mask, opts);
    return;
  }

  if (comm.size() == 1 && std::is_same<typename OV::non_const_value_type, T>::value) {
    attend_shard(exec, fn, cache, s0, s1, q, o, lse, mask, opts, opts.sinks, prefill);
    return;
  }
  // Partials in the compute type (16-bit outputs are rounded once, after the merge).
  Kokkos::View<CT****, Kokkos::LayoutRight, mem> o_part(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::o_part"), B, N, H, D);
  Kokkos::View<CT***, Kokkos::LayoutRight, mem> lse_part(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::lse_part"), B, H, N);
  attend_shard(exec, fn, cache, s0, s1, q, o_part, lse_part, mask, opts, SinkLogits{}, prefill);
  // Every rank merges the rows and folds the sinks in once, before the
  // output's one rounding.
  merge_over_ranks(comm, exec, fn, opts.merge, opts.timeout_seconds, o_part, lse_part, o, lse,
                   opts.sinks);
}

}  // namespace impl

/// Decode over a sharded KV cache (a KVCache or a PagedKVCache, whose pages
/// are read in place): for every sequence of `cache`, the queries
/// q (sequences, rows, heads, head_dim) of its last `rows` tokens (appended
/// to the cache before the call) attend every cached token of the sequence,
/// on whichever rank it lives, under `mask` on global positions (query i of
/// sequence s at cache.length(s) - rows + i). o, lse: (sequences, rows, heads,
/// head_dim), (sequences, heads, rows), the same on every rank. Collective
/// over comm; a configuration that differs between ranks throws the same
/// error on every rank.
template <class C, class ExecSpace, class Cache, class QV, class OV, class LV,
          class Mask = CausalMask,
          class = std::enable_if_t<impl::is_serving_cache<Cache>::value &&
                                   std::is_same<typename Cache::execution_space, ExecSpace>::value>>
void decode_attention(C& comm, const ExecSpace& exec, const Cache& cache, const QV& q, const OV& o,
                      const LV& lse, const Mask& mask = {}, const ServeOptions& opts = {}) {
  using T = typename Cache::value_type;
  impl::check_communicator<C>();
  static_assert(Kokkos::is_view<QV>::value && QV::rank == 4 &&
                    std::is_same<typename QV::non_const_value_type, T>::value,
                "BlockAttn: decode_attention's q must be a rank-4 View of the cache's value type");
  impl::attend_cache(comm, exec, "decode_attention", cache, 0, cache.sequences(), q, o, lse, mask,
                     opts, std::string());
}

/// Chunked prefill of sequence `seq`: appends the chunk's keys and values
/// k, v (1, tokens, kv_heads, head_dim) to the cache (each rank keeps its
/// own), then the chunk's queries q (1, tokens, heads, head_dim) attend the
/// whole cached sequence, themselves included, under `mask` (causal: each
/// sees the cache and the chunk up to itself). o, lse: (1, tokens, heads,
/// head_dim), (1, heads, tokens). Collective over comm. `cache`: a KVCache
/// or a PagedKVCache (the forward's kernels read a copy of a paged shard;
/// the decode kernel its pages).
template <class C, class ExecSpace, class Cache, class QV, class KV, class VV, class OV, class LV,
          class Mask = CausalMask,
          class = std::enable_if_t<impl::is_serving_cache<Cache>::value &&
                                   std::is_same<typename Cache::execution_space, ExecSpace>::value>>
void prefill_attention(C& comm, const ExecSpace& exec, Cache& cache, int seq, const QV& q,
                       const KV& k, const VV& v, const OV& o, const LV& lse, const Mask& mask = {},
                       const ServeOptions& opts = {}) {
  using T = typename Cache::value_type;
  impl::check_communicator<C>();
  static_assert(Kokkos::is_view<QV>::value && QV::rank == 4 &&
                    std::is_same<typename QV::non_const_value_type, T>::value,
                "BlockAttn: prefill_attention's q must be a rank-4 View of the cache's value type");
  const char* fn = "prefill_attention";
  std::string error;
  if (seq < 0 || seq >= cache.sequences())
    error = std::string("blockattn::") + fn + ": argument 'seq' = " + std::to_string(seq) +
            ", expected 0 .. " + std::to_string(cache.sequences() - 1);
  else if (q.extent(1) != k.extent(1))
    error = std::string("blockattn::") + fn + ": argument 'k' has " + std::to_string(k.extent(1)) +
            " tokens, expected the " + std::to_string(q.extent(1)) + " query rows of q";
  else {
    // The append's own checks, before anything is appended on any rank: its
    // shapes (this rank's) and the capacity (the same on every rank).
    try {
      cache.check_append(fn, seq, seq + 1, k, v, "k", "v");
    } catch (const invalid_argument& e) {
      error = e.what();
    }
  }
  // The chunk goes into the cache once every rank agreed (nothing is
  // appended anywhere when one rank's arguments are wrong), then its queries
  // attend the cache.
  const int s0 = error.empty() ? seq : 0;
  const index_type n = error.empty() ? index_type(k.extent(1)) : 0;
  impl::attend_cache(
      comm, exec, fn, cache, s0, s0 + 1, q, o, lse, mask, opts, error, n,
      [&] { cache.append(exec, seq, k, v); }, /*prefill=*/true);
}

/// Appends k, v (sequences, tokens, kv_heads, head_dim) to every sequence of
/// `cache` (seq = -1; k, v: (1, tokens, ...) for one sequence `seq`) as one
/// collective call: each rank checks its part (the shapes; a PagedKVCache
/// its own pool's free pages), the ranks agree, and either every rank
/// appends or every rank throws the same error, nothing appended anywhere.
template <class C, class ExecSpace, class Cache, class KV, class VV,
          class = std::enable_if_t<impl::is_serving_cache<Cache>::value &&
                                   std::is_same<typename Cache::execution_space, ExecSpace>::value>>
void append_kv(C& comm, const ExecSpace& exec, Cache& cache, int seq, const KV& k, const VV& v,
               const ServeOptions& opts = {}) {
  impl::check_communicator<C>();
  const char* fn = "append_kv";
  std::string error;
  const int s0 = seq < 0 ? 0 : seq, s1 = seq < 0 ? cache.sequences() : seq + 1;
  if (seq >= cache.sequences())
    error = std::string("blockattn::") + fn + ": argument 'seq' = " + std::to_string(seq) +
            ", expected -1 (all) or 0 .. " + std::to_string(cache.sequences() - 1);
  else
    error = impl::cache_rank_error(comm, fn, cache);
  if (error.empty()) {
    try {
      cache.check_append(fn, s0, s1, k, v, "k", "v");
    } catch (const invalid_argument& e) {
      error = e.what();
    }
  }
  if (opts.check_config) {
    impl::Fingerprint f;
    f.text("call", fn).number("sequence", seq).number("tokens (k.extent(1))", k.extent(1));
    impl::reach_consensus(comm, fn, error, f);
  } else if (!error.empty()) {
    throw invalid_argument(error);
  }
  if (seq < 0)
    cache.append(exec, k, v);
  else
    cache.append(exec, seq, k, v);
}

}  // namespace blockattn
