// SPDX-License-Identifier: Apache-2.0
// The first half of every distributed driver's argument check
// (DistributedAttention, UlyssesAttention, HybridAttention): this rank's own
// checks of the local Views, then one consensus step over the communicator
// on a fingerprint of the call (the driver's own fields, then the mask, value
// type, shapes and options). After it every rank holds the same
// configuration, so the driver's remaining checks throw on every rank or none.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/sinks.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/policy/partition.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {
namespace impl {

/// The member types every distributed driver (DistributedAttention,
/// UlyssesAttention, HybridAttention) names.
template <class Partition, class Mask, class Communicator, class ExecSpace>
struct DriverTypes {
  using partition_type = Partition;
  using mask_type = Mask;
  using communicator_type = Communicator;
  using execution_space = ExecSpace;
};

/// `describe(Fingerprint&)` adds the driver's fields after "call" (schedule,
/// partition, grid); `extra()` runs more per-rank checks (the backward's);
/// `opts` is the driver's DistributedOptions (scale, check_policies, and
/// communicate when `uses_communicate`). Without `lengths` every rank must
/// hold the same number of tokens (compared like the other shapes); with it,
/// ranks may hold different numbers, none included, and (*lengths)[r] is the
/// local length of rank r on return.
template <class ExecSpace, class Comm, class Mask, class Opts, class QV, class KV, class VV,
          class OV, class LV, class Describe, class Extra>
BlockExtents agree_on_call(Comm& comm, const char* name, const Mask& mask, const QV& q, const KV& k,
                           const VV& v, const OV& o, const LV& lse, const Opts& opts,
                           bool uses_communicate, const Describe& describe, const Extra& extra,
                           std::vector<std::int64_t>* lengths = nullptr) {
  using T = typename OV::non_const_value_type;
  std::string error;
  BlockExtents e;
  // The host fp32 kernels' ISA (run-time dispatch, kernel/isa.hpp): ranks on
  // different CPUs may pick different ones, whose tile sizes (and so packed
  // buffers that travel) and last bits differ.
  // The machine's, whatever T is: a value type that differs between ranks is
  // reported as such, not also as an ISA difference.
  std::string kernel_isa = "none (not on the host)";
  try {
    if constexpr (is_host_space_v<ExecSpace>) kernel_isa = host_isa_name(dispatched_host_isa());
    e = validate_forward<ExecSpace>(name, q, k, v, o, lse, opts.scale, lengths != nullptr);
    if (k.extent(1) != q.extent(1))
      fail(name, "argument 'k' has extent(1) (seq) = ", k.extent(1), ", expected ", q.extent(1),
           " (the local length of q: q, k and v hold the same tokens)");
    extra();
    check_sinks(name, opts.sinks, opts.sink_grad, e.heads, true);
    if (const std::string why = score_check(mask, e.heads); !why.empty())
      fail(name, "argument 'mask': ", why);
  } catch (const invalid_argument& ex) {
    error = ex.what();
  }
  Fingerprint f;
  f.text("call", name);
  describe(f);
  add_mask(f, mask);
  f.text("value type", type_name<T>()).number("batch (q.extent(0))", e.batch);
  if (!lengths) f.number("local length (q.extent(1))", e.queries);
  f.number("heads (q.extent(2))", e.heads)
      .number("kv heads (k.extent(2))", e.kv_heads)
      .number("head_dim (q.extent(3))", e.dim)
      .real(
          "options.scale", opts.scale,
          std::isnan(opts.scale) ? std::string("default (1/sqrt(head_dim))") : to_text(opts.scale));
  if (uses_communicate) f.number("options.communicate", opts.communicate ? 1 : 0);
  f.text("options.sinks", sink_text<ExecSpace>(opts.sinks))
      .number("options.sink_grad (set)", opts.sink_grad.data() ? 1 : 0);
  f.number("options.check_policies (or BLOCKATTN_CHECK_POLICIES)",
           check_policies_always || opts.check_policies ? 1 : 0);
  // Which implementation computes the block pairs (the last bits differ).
  const HostMatrix hm = opts.host_matrix;
  f.number("options.portable_only", opts.portable_only ? 1 : 0)
      .text("options.host_matrix", hm == HostMatrix::automatic ? "automatic"
                                   : hm == HostMatrix::off     ? "off"
                                                               : "avx512_bf16")
      .number("options.tensor_cores", opts.tensor_cores ? 1 : 0)
      .number("options.tensor_core_backward", opts.tensor_core_backward ? 1 : 0)
      .number("options.guard_masked_nonfinite", opts.guard_masked_nonfinite ? 1 : 0)
      .number("options.invariant", opts.invariant ? 1 : 0)
      .number("options.invariant_tile", opts.invariant_tile);
  f.text(
      "host ISA of the fp32 kernels (dispatched_host_isa(); the same BLOCKATTN_HOST_ISA on "
      "every rank makes them agree)",
      kernel_isa);
  reach_consensus(comm, name, error, f, e.queries, lengths);
  return e;
}

/// After a consensus that gathered every rank's local length: the global
/// length N (their sum), and each rank's length checked against
/// `expected(N, r)`; `layout(N)` names the layout in the error ("the zigzag
/// partition of N = ... over P = ... ranks"), `rule` the function users call.
/// The same data on every rank, so it throws on every rank or on none.
template <class Expected, class Layout>
index_type agreed_length(const char* name, const std::vector<std::int64_t>& lengths,
                         const Expected& expected, const Layout& layout, const char* rule) {
  const int P = int(lengths.size());
  index_type N = 0;
  for (const std::int64_t n : lengths) N += n;
  if (N == 0)
    fail(name, "every rank holds 0 tokens (q.extent(1) = 0 on all ", P,
         " ranks), expected a global sequence of at least 1 token");
  std::vector<std::int64_t> want(static_cast<std::size_t>(P));
  bool ok = true;
  for (int r = 0; r < P; ++r) {
    want[std::size_t(r)] = expected(N, r);
    ok = ok && lengths[std::size_t(r)] == want[std::size_t(r)];
  }
  if (ok) return N;
  // Name the odd ranks: those that differ from the majority's length when
  // more than half the ranks hold the same; else every rank's length.
  std::map<std::int64_t, std::vector<int>> by_length;
  for (int r = 0; r < P; ++r) by_length[lengths[std::size_t(r)]].push_back(r);
  const auto most = std::max_element(by_length.begin(), by_length.end(), [](auto& a, auto& b) {
    return a.second.size() < b.second.size();
  });
  std::ostringstream held;
  if (2 * most->second.size() > std::size_t(P)) {
    std::vector<int> odd;
    for (int r = 0; r < P; ++r)
      if (lengths[std::size_t(r)] != most->first) odd.push_back(r);
    held << (odd.size() > 1 ? "ranks " : "rank ") << rank_list(odd)
         << (odd.size() > 1 ? " hold " : " holds ");
    for (std::size_t i = 0; i < odd.size() && i < 8; ++i)
      held << (i ? ", " : "") << lengths[std::size_t(odd[i])];
    held << (odd.size() > 8 ? ", ..." : "") << " tokens (q.extent(1)) where the other "
         << P - int(odd.size()) << " hold " << most->first;
  } else {
    held << "the ranks hold ";
    bool first = true;
    for (const auto& [n, ranks] : by_length) {
      held << (first ? "" : "; ") << n << " tokens on rank" << (ranks.size() > 1 ? "s " : " ")
           << rank_list(ranks);
      first = false;
    }
    held << " (q.extent(1)), no length on more than half of them";
  }
  std::ostringstream gives;  // what the layout gives, grouped the same way
  std::map<std::int64_t, std::vector<int>> by_want;
  for (int r = 0; r < P; ++r) by_want[want[std::size_t(r)]].push_back(r);
  bool first = true;
  for (const auto& [n, ranks] : by_want) {
    gives << (first ? "" : ", ") << n << " to rank" << (ranks.size() > 1 ? "s " : " ")
          << rank_list(ranks);
    first = false;
  }
  fail(name, held.str(), "; ", layout(N), " gives ", gives.str(), "; expected ", rule,
       " tokens on every rank");
  return N;
}

/// The same for a partition over all the lengths' ranks.
template <class Partition>
index_type agreed_length(const Partition& partition, const char* name,
                         const std::vector<std::int64_t>& lengths) {
  const int P = int(lengths.size());
  return agreed_length(
      name, lengths,
      [&](index_type N, int r) {
        require_partitionable(partition, name, N, P);
        return local_length(partition, N, P, r);
      },
      [&](index_type N) {
        std::ostringstream s;
        s << "the " << Partition::name() << " partition of N = " << N
          << " tokens (the sum over the ranks) over P = " << P << " ranks";
        return s.str();
      },
      splits_any_length_v<Partition>
          ? "local_length<Partition>(N, P, rank)"
          : "local_length<Partition>(N, P, rank) (N / P: this partition has no length())");
}
template <class Partition>
index_type agreed_length(const char* name, const std::vector<std::int64_t>& lengths) {
  return agreed_length(Partition{}, name, lengths);
}

/// A partition whose positions live in a memory space (TablePartition) must
/// be readable from the execution space; a stateless one always is.
template <class Partition, class ExecSpace, class = void>
struct partition_memory_ok : std::true_type {};
template <class Partition, class ExecSpace>
struct partition_memory_ok<Partition, ExecSpace, std::void_t<typename Partition::memory_space>>
    : std::bool_constant<
          Kokkos::SpaceAccessibility<ExecSpace, typename Partition::memory_space>::accessible> {};
template <class Partition, class ExecSpace>
constexpr bool partition_accessible_from() {
  return partition_memory_ok<Partition, ExecSpace>::value;
}

}  // namespace impl
}  // namespace blockattn
