// SPDX-License-Identifier: Apache-2.0
// Attention sinks in the distributed calls (kernel/sinks.hpp): the forward
// folds each row's sink in once, on the rank that returns the row, after the
// schedule has merged every partial result of it; the backward's sink
// gradient is each rank's sum over its rows, summed over the ranks.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/sinks.hpp>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn::impl {

/// opts.sink_grad = dL/dsinks over the rows of every rank of `comm` (the same
/// values on every rank). Collective when opts.sink_grad is set (the
/// consensus has made that the same on every rank).
template <class Comm, class ExecSpace, class OV, class DOV, class LV>
void distributed_sink_gradient(Comm& comm, const ExecSpace& exec, const DistributedOptions& opts,
                               const OV& o, const DOV& dout, const LV& lse) {
  if (opts.sink_grad.data() == nullptr) return;
  const auto part = sink_gradient_part(exec, opts.sinks, o, dout, lse);
  const auto mine = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), part);
  const int H = int(mine.extent(0));
  std::vector<double> in(mine.data(), mine.data() + H), sum(std::size_t(H), 0.0);
  allreduce_values(comm, in.data(), sum.data(), H, ReduceOp::sum);
  const Kokkos::View<const double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>
      host(sum.data(), std::size_t(H));
  Kokkos::deep_copy(exec, part, host);
  store_sink_gradient(exec, part, opts.sink_grad);
  exec.fence();  // `sum` goes out of scope
}

/// The sink logits as text, for the consensus ("none", or the values).
template <class ExecSpace>
std::string sink_text(const SinkLogits& sinks) {
  if (sinks.data() == nullptr) return "none";
  const sink_view<typename ExecSpace::memory_space> s(sinks.data(), sinks.extent(0));
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), s);
  std::ostringstream t;
  t.precision(9);
  t << "{";
  for (std::size_t i = 0; i < h.extent(0); ++i) t << (i ? ", " : "") << h(i);
  t << "}";
  return t.str();
}

/// The options without sinks: for the inner calls of a driver that folds
/// them in itself (HybridAttention's ring runs on a slice of the heads).
inline DistributedOptions without_sinks(DistributedOptions opts) {
  opts.sinks = SinkLogits();
  opts.sink_grad = SinkGradient();
  return opts;
}

}  // namespace blockattn::impl
