// SPDX-License-Identifier: Apache-2.0
// The description of the head-parallel all-to-all (DeepSpeed-Ulysses,
// arXiv:2309.14509): which heads each rank computes, and what its all-to-alls
// move and allocate. The driver is UlyssesAttention
// (blockattn/distributed/ulysses.hpp); the planner reads the same description.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <string>

namespace blockattn {

/// Which heads each rank computes under UlyssesAttention.
struct UlyssesHeads {
  int heads = 0, kv_heads = 0, P = 1;
  int heads_per_rank = 0;     // query heads per rank: H / P
  int kv_heads_per_rank = 0;  // K/V heads each rank receives
  bool replicated = false;    // a K/V head goes to more than one rank
  int first_head(int r) const { return r * heads_per_rank; }
  int first_kv_head(int r) const { return r * heads_per_rank / (heads / kv_heads); }
  /// Empty when the shape works, else why not.
  static std::string why_not(int heads, int kv_heads, int P) {
    if (heads % P != 0)
      return "heads (q.extent(2)) = " + std::to_string(heads) +
             " is not a multiple of the number of ranks P = " + std::to_string(P) +
             " (Ulysses gives every rank H / P query heads)";
    const int hp = heads / P, g = heads / kv_heads;
    if (hp % g != 0 && g % hp != 0)
      return "kv heads (k.extent(2)) = " + std::to_string(kv_heads) + " with " +
             std::to_string(heads) + " heads over P = " + std::to_string(P) + " ranks: a rank's " +
             std::to_string(hp) + " query heads must cover whole K/V groups of " +
             std::to_string(g) +
             " heads, or lie inside one (expected H/P a multiple of H/H_kv, or H/H_kv a "
             "multiple of H/P)";
    return {};
  }
  static UlyssesHeads make(int heads, int kv_heads, int P) {
    UlyssesHeads u;
    u.heads = heads;
    u.kv_heads = kv_heads;
    u.P = P;
    u.heads_per_rank = heads / P;
    const int g = heads / kv_heads;
    u.kv_heads_per_rank = u.heads_per_rank % g == 0 ? u.heads_per_rank / g : 1;
    u.replicated = u.kv_heads_per_rank * P > kv_heads;
    return u;
  }
};

/// What one forward call of UlyssesAttention moves and allocates per rank
/// (every rank the same): batch b, N tokens over P ranks (n = `most`, the
/// longest rank's tokens, the rows of every all-to-all chunk; 0: N / P),
/// head dim d, storage bytes s, compute bytes cs, and `packed` = the bytes of
/// the packed K/V block of the local attention (compute type).
///   sent: (P-1)/P of Q, K, V (K/V once per receiving rank) and O in s, LSE in cs;
///   peak workspace: the rank/position index (8 P n), Q, K, V, O of this rank's
///   heads over N tokens in s, their LSE in cs, plus the largest transient of
///   the phases: the packed block, or O's / the LSE's send and receive buffers.
struct UlyssesForwardVolume {
  std::int64_t sent = 0, workspace = 0;
};

inline UlyssesForwardVolume ulysses_forward_volume(const UlyssesHeads& u, int batch, index_type N,
                                                   int dim, int s, int cs, std::int64_t packed,
                                                   index_type most = 0) {
  const std::int64_t P = u.P, n = most > 0 ? most : N / P, hq = u.heads_per_rank,
                     hk = u.kv_heads_per_rank;
  const std::int64_t rows = std::int64_t(batch) * n * dim * (P - 1);  // one head, to P-1 ranks
  UlyssesForwardVolume v;
  v.sent = rows * s * (2 * hq + 2 * hk) + std::int64_t(batch) * n * (P - 1) * hq * cs;
  const std::int64_t full = std::int64_t(batch) * N * dim * s;  // one head, all N tokens
  const std::int64_t lse = std::int64_t(batch) * hq * N * cs;
  // Send or receive buffer of an all-to-all: P chunks of n rows (P n >= N).
  const std::int64_t chunks = std::int64_t(batch) * P * n * dim * s,
                     lse_chunks = std::int64_t(batch) * hq * P * n * cs;
  std::int64_t transient = packed;
  if (2 * chunks * hq > transient) transient = 2 * chunks * hq;
  if (2 * lse_chunks > transient) transient = 2 * lse_chunks;
  // During the K/V all-to-alls (Q held, K or V with its send and receive buffers):
  const std::int64_t before = full * (hq + 2 * hk) + 2 * chunks * hk;
  const std::int64_t after = full * (2 * hq + 2 * hk) + lse + transient;
  v.workspace = 8 * P * n + (before > after ? before : after);
  return v;
}

/// What one backward call of UlyssesAttention (g = cs) or of HybridAttention's
/// group (g = s; `packed`: its ring's workspace) moves and allocates per rank,
/// in the order the run holds its buffers: the rank/position index (8 P n);
/// Q, K, V, O, dO of this rank's heads over N tokens in s and their LSE in cs,
/// each with its all-to-all's send and receive buffers while it runs; dQ over
/// N tokens in s, dK and dV in g; `packed` (the local backward's packed keys
/// and rows, or the ring's workspace) while it computes; then the send and
/// receive buffers of dQ (s), dK and dV (g) on the way back.
///   sent: (P-1)/P of Q, K, V, O, dO in s, LSE in cs, dQ in s, dK, dV in g.
inline UlyssesForwardVolume ulysses_backward_volume(const UlyssesHeads& u, int batch, index_type N,
                                                    int dim, int s, int cs, int g,
                                                    std::int64_t packed, index_type most = 0) {
  const std::int64_t P = u.P, n = most > 0 ? most : N / P, hq = u.heads_per_rank,
                     hk = u.kv_heads_per_rank, b = batch;
  UlyssesForwardVolume v;
  std::int64_t now = 8 * P * n, peak = now;
  const auto hold = [&](std::int64_t bytes) {
    now += bytes;
    peak = now > peak ? now : peak;
  };
  const auto transient = [&](std::int64_t bytes) {
    peak = now + bytes > peak ? now + bytes : peak;
  };
  // In: one all-to-all per tensor (heads hh, bytes e per value).
  const auto in = [&](std::int64_t hh, std::int64_t e) {
    transient(2 * P * b * n * hh * dim * e + b * N * hh * dim * e);
    hold(b * N * hh * dim * e);
    v.sent += (P - 1) * b * n * hh * dim * e;
  };
  in(hq, s);                                             // Q
  in(hk, s);                                             // K
  in(hk, s);                                             // V
  in(hq, s);                                             // O
  in(hq, s);                                             // dO
  transient(2 * P * b * hq * n * cs + b * hq * N * cs);  // LSE
  hold(b * hq * N * cs);
  v.sent += (P - 1) * b * hq * n * cs;
  hold(b * N * dim * (hq * s + 2 * hk * g));  // dQ, dK, dV over the whole sequence
  transient(packed);
  // Out: dQ, then dK and dV, each through its send and receive buffers.
  transient(2 * P * b * n * hq * dim * s);
  transient(2 * P * b * n * hk * dim * g);
  v.sent += (P - 1) * b * n * dim * (hq * s + 2 * hk * g);
  v.workspace = peak;
  return v;
}

}  // namespace blockattn
