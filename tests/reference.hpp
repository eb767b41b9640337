// SPDX-License-Identifier: Apache-2.0
// fp64 naive attention on the host: the oracle of every forward test. The
// loops are in reference.cpp (reference_core.hpp); here a mask policy and the
// position offsets become the table they read.
#pragma once

#include <blockattn/blockattn.hpp>

#include "reference_core.hpp"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace blockattn::test {

/// The mask of one call as reference_core.hpp reads it: allowed() of every
/// (q_offset + i, k_offset + j), and a score policy's score / score_grad.
template <class Mask>
ReferenceMask reference_mask(const Mask& mask, int nq, int nk, index_type q_offset,
                             index_type k_offset) {
  ReferenceMask m;
  m.nq = nq;
  m.nk = nk;
  m.allowed.resize(std::size_t(nq) * std::size_t(nk));
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j)
      m.allowed[std::size_t(i) * nk + j] = mask.allowed(q_offset + i, k_offset + j) ? 1 : 0;
  if constexpr (impl::has_score_mod_v<Mask>) {
    m.score = [mask, q_offset, k_offset](double s, int i, int j, int h) {
      return mask.score(s, q_offset + i, k_offset + j, h);
    };
    m.score_grad = [mask, q_offset, k_offset](double s, int i, int j, int h) {
      return mask.score_grad(s, q_offset + i, k_offset + j, h);
    };
  }
  return m;
}

/// O and LSE in fp64 straight from the definition, for any mask policy and
/// position offsets. Inputs are taken as given (already rounded to the test's
/// value type), so the result is the exact answer for those inputs.
/// A score policy on the mask (policy/score.hpp) changes the logits of the
/// allowed pairs; `sinks` (one logit per head) joins every row's denominator.
template <class Mask>
ReferenceResult reference_attention(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                                    const Mask& mask, double scale, index_type q_offset = 0,
                                    index_type k_offset = 0,
                                    const std::vector<double>* sinks = nullptr) {
  return reference_attention_table(q, k, v, reference_mask(mask, q.n, k.n, q_offset, k_offset),
                                   scale, sinks);
}

/// Gradients of L = sum(dO o O) in fp64 straight from the definition:
/// P = softmax(masked scale Q K^T), dV = P^T dO, dP = dO V^T,
/// dS = P o (dP - rowsum(P o dP)), dQ = scale dS K, dK = scale dS^T Q.
/// With `o_used`, rowsum(P o dP) = rowsum(dO o O) is formed from that O
/// instead (the O a 16-bit forward returned, rounded, as the kernels use it).
/// With `terms`, also the sums of each gradient element's absolute terms
/// (ReferenceGrads::abs_dq, abs_dk, abs_dv).
template <class Mask>
ReferenceGrads reference_backward(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                                  const HostTensor& dout, const Mask& mask, double scale,
                                  index_type q_offset = 0, index_type k_offset = 0,
                                  const HostTensor* o_used = nullptr,
                                  const std::vector<double>* sinks = nullptr, bool terms = false) {
  return reference_backward_table(q, k, v, dout, reference_mask(mask, q.n, k.n, q_offset, k_offset),
                                  scale, o_used, sinks, terms);
}

}  // namespace blockattn::test
