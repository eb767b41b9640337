// SPDX-License-Identifier: Apache-2.0
// Mixed serving batches: one collective call in which some sequences bring
// one new token (decode) and others a chunk of their prompt (chunked
// prefill), over a KVCache or a PagedKVCache sharded across the ranks. The
// rows of all sequences travel packed in one View (FlashInfer's ragged
// batch, vLLM's unified step); one consensus, one append and one merge over
// the ranks serve them all. Each sequence's rows run the kernel a separate
// prefill_attention of them would (the split-KV decode kernel, or the
// forward's kernels for a long chunk) and the merge sums every row in a
// fixed order (distributed/impl/merge_ranks.hpp): the results are bitwise
// those of one prefill_attention per sequence, in the batch's order.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/distributed/decode.hpp>
#include <blockattn/distributed/impl/cache_access.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/invariant_serve.hpp>
#include <blockattn/distributed/impl/merge_ranks.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/policy/mask.hpp>

#include <algorithm>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

/// The sequences of one serving step and the new tokens each brings: row
/// block i of the call's packed Views holds rows[i] tokens of sequence
/// sequences[i] (1: a decode step; more: a prefill chunk), the blocks in
/// this order.
struct ServeBatch {
  std::vector<int> sequences;  // distinct sequences of the cache
  std::vector<int> rows;       // >= 1 each
  /// The first packed row of block i, and the rows of all blocks (i = size);
  /// O(i): offsets() has them all at once.
  index_type offset(std::size_t i) const {
    index_type o = 0;
    for (std::size_t b = 0; b < i && b < rows.size(); ++b) o += rows[b];
    return o;
  }
  /// offset(i) for i = 0 .. size (size + 1 entries).
  std::vector<index_type> offsets() const {
    std::vector<index_type> o(rows.size() + 1, 0);
    for (std::size_t b = 0; b < rows.size(); ++b) o[b + 1] = o[b] + rows[b];
    return o;
  }
  index_type total() const { return offset(rows.size()); }
};

namespace impl {

/// This rank's checks of a batch against the cache (the sequences, their
/// rows, the packed k and v, the appends' room); empty if none.
template <class Cache, class QV, class KV, class VV>
std::string batch_error(const char* fn, const Cache& cache, const ServeBatch& batch, const QV& q,
                        const KV& k, const VV& v) {
  const std::string at = std::string("blockattn::") + fn + ": ";
  if (batch.sequences.empty() || batch.sequences.size() != batch.rows.size())
    return at + "argument 'batch' has " + std::to_string(batch.sequences.size()) +
           " sequences and " + std::to_string(batch.rows.size()) +
           " row counts; expected one row count per sequence, at least one sequence";
  std::vector<char> seen(std::size_t(cache.sequences()), 0);
  for (std::size_t i = 0; i < batch.sequences.size(); ++i) {
    const int s = batch.sequences[i];
    if (s < 0 || s >= cache.sequences())
      return at + "argument 'batch' holds sequence " + std::to_string(s) + " at " +
             std::to_string(i) + ", expected 0 .. " + std::to_string(cache.sequences() - 1);
    if (seen[std::size_t(s)]++)
      return at + "argument 'batch' holds sequence " + std::to_string(s) +
             " twice; expected each sequence once (its rows in one block)";
    if (batch.rows[i] < 1)
      return at + "argument 'batch' gives sequence " + std::to_string(s) + " " +
             std::to_string(batch.rows[i]) + " rows, expected >= 1";
  }
  const index_type T = batch.total();
  if (index_type(q.extent(1)) != T)
    return at + "argument 'q' has " + std::to_string(q.extent(1)) +
           " rows (extent(1)), expected the batch's " + std::to_string(T);
  if (index_type(k.extent(1)) != T || index_type(v.extent(1)) != T)
    return at + "arguments 'k', 'v' have " + std::to_string(k.extent(1)) + ", " +
           std::to_string(v.extent(1)) + " tokens (extent(1)), expected the batch's " +
           std::to_string(T);
  int pages = 0;
  const std::vector<index_type> at_row = batch.offsets();
  for (std::size_t i = 0; i < batch.sequences.size(); ++i) {
    const int s = batch.sequences[i];
    const auto r = Kokkos::make_pair(at_row[i], at_row[i + 1]);
    try {
      cache.check_append(fn, s, s + 1, Kokkos::subview(k, Kokkos::ALL, r, Kokkos::ALL, Kokkos::ALL),
                         Kokkos::subview(v, Kokkos::ALL, r, Kokkos::ALL, Kokkos::ALL), "k", "v");
    } catch (const invalid_argument& e) {
      return e.what();
    }
    if constexpr (is_paged_cache<Cache>::value) pages += cache.pages_to_append(s, batch.rows[i]);
  }
  if constexpr (is_paged_cache<Cache>::value) {
    if (pages > cache.free_pages())
      return at + "the page pool of rank " + std::to_string(cache.rank()) +
             " is exhausted: the batch's appends need " + std::to_string(pages) + " pages, " +
             std::to_string(cache.free_pages()) + " of " + std::to_string(cache.pages()) +
             " are free; expected a batch that fits: release sequences or build the cache with " +
             "more pages";
  }
  return std::string();
}

/// Packed rows [o0, o0 + B N) of a (1, rows, heads, dim) View as (B, N,
/// heads, dim): the rows of B blocks of N rows each.
template <class V>
auto rows_as_batch(const V& x, index_type o0, int B, int N) {
  using Out = Kokkos::View<typename V::value_type****, Kokkos::LayoutStride,
                           typename V::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const std::size_t s1 = x.stride(1);
  return Out(x.data() + std::size_t(o0) * s1,
             Kokkos::LayoutStride(std::size_t(B), s1 * std::size_t(N), std::size_t(N), s1,
                                  x.extent(2), x.stride(2), x.extent(3), x.stride(3)));
}
/// The same rows' LSE of a (1, heads, rows) View as (B, heads, N).
template <class V>
auto lse_as_batch(const V& x, index_type o0, int B, int N) {
  using Out = Kokkos::View<typename V::value_type***, Kokkos::LayoutStride,
                           typename V::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const std::size_t s2 = x.stride(2);
  return Out(x.data() + std::size_t(o0) * s2,
             Kokkos::LayoutStride(std::size_t(B), s2 * std::size_t(N), x.extent(1), x.stride(1),
                                  std::size_t(N), s2));
}

/// The batch's blocks cut into runs [runs[r], runs[r + 1]) of the n blocks:
/// a run of several blocks is consecutive sequences of the cache with the
/// same rows on the split-KV decode kernel (one launch, each sequence with
/// the key ranges a launch of its own would take: decode_splits); every
/// other block is a run of its own.
template <class T, class ExecSpace>
std::vector<int> decode_runs(const ExecSpace& exec, const ServeBatch& batch, int n, int H, int D,
                             const ServeOptions& opts) {
  const auto seq = [&](int i) { return batch.sequences[std::size_t(i)]; };
  const auto rows = [&](int i) { return batch.rows[std::size_t(i)]; };
  std::vector<int> runs{0};
  for (int i = 0; i < n;) {
    int j = i + 1;
    if (!prefill_on_forward_pays<T>(exec, opts, rows(i), H, D))
      while (j < n && seq(j) == seq(j - 1) + 1 && rows(j) == rows(i)) ++j;
    runs.push_back(j);
    i = j;
  }
  return runs;
}

/// The key ranges of blocks [i, j) of a run, each as its own launch would
/// take them, in the execution space's memory.
template <class ExecSpace, class Cache>
Kokkos::View<int*, typename ExecSpace::memory_space> decode_splits(const ExecSpace& exec,
                                                                   const Cache& cache,
                                                                   const ServeBatch& batch, int i,
                                                                   int j, int H,
                                                                   const ServeOptions& opts) {
  Kokkos::View<int*, typename ExecSpace::memory_space> d("blockattn::sequence_splits",
                                                         std::size_t(j - i));
  auto h = Kokkos::create_mirror_view(d);
  for (int b = i; b < j; ++b) {
    const int s = batch.sequences[std::size_t(b)];
    h(b - i) = cache_decode_splits(exec, cache, 1, batch.rows[std::size_t(b)], H,
                                   cache.local_length(s), opts.splits);
  }
  Kokkos::deep_copy(d, h);
  return d;
}

}  // namespace impl

/// One serving step for a mixed batch: appends the new tokens k, v (1,
/// batch.total(), kv_heads, head_dim; block i to sequence
/// batch.sequences[i]) to the cache (each rank keeps its own), then their
/// queries q (1, batch.total(), heads, head_dim) attend their sequences,
/// themselves included, under `mask` on global positions (row r of block i
/// at cache.length(s) - rows[i] + r after the append). o, lse: (1,
/// batch.total(), heads, head_dim), (1, heads, batch.total()), the same on
/// every rank. Collective over comm: the ranks agree first (the batch, the
/// lengths, the configuration), and either every rank appends or every rank
/// throws the same error, nothing appended anywhere (a pool that cannot take
/// the batch's pages on one rank included). Bitwise the results of
/// prefill_attention on each block in the batch's order (a decode row is a
/// chunk of one); decode_attention batches its sequences in one launch whose
/// key splits depend on the batch, so its bits may differ from these.
template <class C, class ExecSpace, class Cache, class QV, class KV, class VV, class OV, class LV,
          class Mask = CausalMask,
          class = std::enable_if_t<impl::is_serving_cache<Cache>::value &&
                                   std::is_same<typename Cache::execution_space, ExecSpace>::value>>
void batch_attention(C& comm, const ExecSpace& exec, Cache& cache, const ServeBatch& batch,
                     const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                     const Mask& mask = {}, const ServeOptions& opts = {}) {
  using T = typename Cache::value_type;
  using CT = compute_t<T>;
  using mem = typename ExecSpace::memory_space;
  impl::check_communicator<C>();
  static_assert(Kokkos::is_view<QV>::value && QV::rank == 4 &&
                    std::is_same<typename QV::non_const_value_type, T>::value,
                "BlockAttn: batch_attention's q must be a rank-4 View of the cache's value type");
  static_assert(
      Kokkos::is_view<KV>::value && KV::rank == 4 && Kokkos::is_view<VV>::value && VV::rank == 4,
      "BlockAttn: batch_attention's k and v must be rank-4 Views");
  const char* fn = "batch_attention";
  std::string error = impl::serve_call_error(comm, fn, cache, 1, q, opts);
  if (error.empty()) error = impl::batch_error(fn, cache, batch, q, k, v);
  const std::string relative = impl::serve_output_error(fn, q, o, lse, opts);
  const int H = int(q.extent(2)), D = int(q.extent(3));
  const int n = error.empty() ? int(batch.sequences.size()) : 0;
  for (int i = 0; i < n && error.empty() && opts.invariant; ++i) {
    const int s = batch.sequences[std::size_t(i)];
    error = impl::invariant_cache_error(fn, cache, s, s + 1, batch.rows[std::size_t(i)],
                                        opts.invariant_tile);
  }
  if (opts.check_config) {
    impl::Fingerprint f = impl::serve_fingerprint<ExecSpace>(fn, cache, H, D, mask, opts, true);
    std::uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](std::int64_t x) {
      h ^= std::uint64_t(x);
      h *= 1099511628211ull;
    };
    for (int i = 0; i < n; ++i) {
      const int s = batch.sequences[std::size_t(i)];
      mix(s);
      mix(batch.rows[std::size_t(i)]);
      mix(cache.length(s));
    }
    f.number("sequences", n)
        .number("rows (q.extent(1))", q.extent(1))
        .number("sequences, rows and lengths (hash)", std::int64_t(h));
    impl::reach_consensus(comm, fn, error, f, 0, nullptr, relative);
  } else if (!error.empty() || !relative.empty()) {
    throw invalid_argument(error.empty() ? relative : error);
  }
  const std::vector<index_type> at_row = batch.offsets();
  const auto block = [&](int i) {
    return Kokkos::make_pair(at_row[std::size_t(i)], at_row[std::size_t(i) + 1]);
  };
  const auto all = Kokkos::ALL;
  // Every rank agreed: the appends, in the batch's order.
  for (int i = 0; i < n; ++i)
    cache.append(exec, batch.sequences[std::size_t(i)], Kokkos::subview(k, all, block(i), all, all),
                 Kokkos::subview(v, all, block(i), all, all));
  if (opts.invariant) {  // each block's rows as its own call: the same bits
    for (int i = 0; i < n; ++i) {
      const int s = batch.sequences[std::size_t(i)];
      impl::invariant_attend(comm, exec, cache, s, s + 1,
                             Kokkos::subview(q, all, block(i), all, all),
                             Kokkos::subview(o, all, block(i), all, all),
                             Kokkos::subview(lse, all, all, block(i)), mask, opts);
    }
    return;
  }
  // Runs of consecutive decode blocks: one launch each, every sequence with
  // the key ranges of a launch of its own (the same bits).
  const std::vector<int> runs = impl::decode_runs<T>(exec, batch, n, H, D, opts);
  std::vector<Kokkos::View<int*, mem>> splits(runs.size());
  for (std::size_t r = 0; r + 1 < runs.size(); ++r)
    if (runs[r + 1] > runs[r] + 1)
      splits[r] = impl::decode_splits(exec, cache, batch, runs[r], runs[r + 1], H, opts);
  const auto attend = [&](const auto& out, const auto& out_lse, const SinkLogits& sinks) {
    for (std::size_t r = 0; r + 1 < runs.size(); ++r) {
      const int i = runs[r], j = runs[r + 1], s = batch.sequences[std::size_t(i)];
      const index_type o0 = at_row[std::size_t(i)];
      const int rows = batch.rows[std::size_t(i)];
      if (j == i + 1) {
        const auto b = Kokkos::make_pair(o0, o0 + rows);
        impl::attend_shard(exec, fn, cache, s, s + 1, Kokkos::subview(q, all, b, all, all),
                           Kokkos::subview(out, all, b, all, all),
                           Kokkos::subview(out_lse, all, all, b), mask, opts, sinks, true);
      } else {
        impl::attend_shard(exec, fn, cache, s, s + (j - i), impl::rows_as_batch(q, o0, j - i, rows),
                           impl::rows_as_batch(out, o0, j - i, rows),
                           impl::lse_as_batch(out_lse, o0, j - i, rows), mask, opts, sinks, false,
                           splits[r]);
      }
    }
  };
  if (comm.size() == 1 && std::is_same<typename OV::non_const_value_type, T>::value) {
    attend(o, lse, opts.sinks);
    return;
  }
  const index_type rows = batch.total();
  Kokkos::View<CT****, Kokkos::LayoutRight, mem> o_part(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::o_part"), 1, rows, H, D);
  Kokkos::View<CT***, Kokkos::LayoutRight, mem> lse_part(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::lse_part"), 1, H, rows);
  attend(o_part, lse_part, SinkLogits{});
  impl::merge_over_ranks(comm, exec, fn, opts.merge, opts.timeout_seconds, o_part, lse_part, o, lse,
                         opts.sinks);
}

}  // namespace blockattn
