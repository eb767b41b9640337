// SPDX-License-Identifier: Apache-2.0
// Packed documents ("cu_seqlens"): many variable-length documents in one
// sequence, each token attending only within its own document, optionally
// causal and within a window.
//
//   blockattn::Documents<> docs(std::vector<blockattn::index_type>{0, 5, 130, 131, 4096});
//   auto mask = docs.mask();                  // causal within each document
//   auto local = docs.mask(true, 255, 0);     // ... and a causal window of 256 keys
//
// Documents owns the offsets twice, on the execution space's memory and on the
// host (the schedules classify blocks on the host); DocumentMask is the small
// trivially copyable view of them that kernels copy. Keep the Documents alive
// while its masks are in use.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/mask.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace blockattn {

/// Document d spans global positions [offsets[d], offsets[d + 1]). A query
/// sees a key iff both lie in the same document, k - q is in [-left, right],
/// and (if causal) k <= q. Positions outside [offsets[0], offsets[documents])
/// belong to no document and see nothing. classify() is exact in the
/// documents (a box whose query and key documents differ is `empty`) and in
/// the band; `partial` otherwise.
struct DocumentMask {
  const index_type* host_offsets = nullptr;    // documents + 1 entries, host memory
  const index_type* device_offsets = nullptr;  // the same, in the execution space's memory
  int documents = 0;
  bool causal = true;
  index_type left = std::numeric_limits<index_type>::max();
  index_type right = std::numeric_limits<index_type>::max();

  KOKKOS_INLINE_FUNCTION const index_type* offsets() const {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
    return device_offsets;
#else
    return host_offsets;
#endif
  }

  /// The document of position t, or -1 outside every document (binary search).
  KOKKOS_INLINE_FUNCTION int document(index_type t) const {
    const index_type* off = offsets();
    if (documents <= 0 || t < off[0] || t >= off[documents]) return -1;
    int lo = 0, hi = documents;  // off[lo] <= t < off[hi]
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      if (off[mid] <= t)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }

  /// The upper end of the band of k - q (causal caps it at 0).
  KOKKOS_INLINE_FUNCTION index_type band_right() const {
    return causal ? (right < 0 ? right : 0) : right;
  }

  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    const index_type d = k - q;  // positions are bounded by 2^62: no overflow
    if (d < -left || d > band_right()) return false;
    const int dq = document(q);
    return dq >= 0 && dq == document(k);
  }

  /// The keys q sees: its document cut to the band (one search instead of two
  /// per pair; see allowed_keys in blockattn/policy/mask.hpp).
  KOKKOS_INLINE_FUNCTION KeyInterval allowed_keys(index_type q) const {
    const int dq = document(q);
    if (dq < 0) return {0, 0};
    const index_type* off = offsets();
    index_type b = off[dq], e = off[dq + 1];
    // Written so that unbounded (huge) left / right never overflow: q - b and
    // e - 1 - q are within the document.
    if (q - b > left) b = q - left;
    const index_type r = band_right();
    if (e - 1 - q > r) e = q + r + 1;
    if (e < b) e = b;
    return {b, e};
  }

  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q_begin, index_type q_end, index_type k_begin,
                                           index_type k_end) const {
    const index_type q_last = q_end - 1, k_last = k_end - 1;
    const index_type lo = k_begin - q_last, hi = k_last - q_begin;
    const index_type r = band_right();
    if (hi < -left || lo > r) return TileKind::empty;
    const index_type* off = offsets();
    if (documents <= 0) return TileKind::empty;
    const index_type first = off[0], end = off[documents];
    // The documents a range touches, clipped to where documents exist.
    const index_type qb = q_begin > first ? q_begin : first,
                     qe = q_last < end - 1 ? q_last : end - 1;
    const index_type kb = k_begin > first ? k_begin : first,
                     ke = k_last < end - 1 ? k_last : end - 1;
    if (qb > qe || kb > ke) return TileKind::empty;
    const int dq0 = document(qb), dq1 = document(qe), dk0 = document(kb), dk1 = document(ke);
    if (dq1 < dk0 || dk1 < dq0) return TileKind::empty;
    const bool inside = qb == q_begin && qe == q_last && kb == k_begin && ke == k_last;
    if (inside && dq0 == dq1 && dk0 == dk1 && dq0 == dk0 && lo >= -left && hi <= r)
      return TileKind::full;
    return TileKind::partial;
  }

  /// Inside one document, the band k - q in [-left, band_right()]; a box
  /// that touches two documents or a position outside every document is not
  /// a band (unless classify() calls it empty). Host only.
  MaskBand band(index_type q_begin, index_type q_end, index_type k_begin, index_type k_end) const {
    const int d = document(q_begin);
    if (d < 0 || document(q_end - 1) != d || document(k_begin) != d || document(k_end - 1) != d)
      return MaskBand::none();
    return MaskBand::of(left == INT64_MIN ? INT64_MAX : -left, band_right());
  }
  /// Compared across ranks by the distributed entry points: the number of
  /// documents, causal, the window, and a fingerprint of the offsets.
  std::array<std::int64_t, 5> parameters() const {
    std::uint64_t h = 1469598103934665603ull;
    for (int d = 0; d <= documents && host_offsets; ++d) {
      h ^= std::uint64_t(host_offsets[d]);
      h *= 1099511628211ull;
    }
    return {{documents, causal ? 1 : 0, left, right, std::int64_t(h)}};
  }
};

/// Owns document offsets (cu_seqlens: strictly increasing, documents + 1
/// entries) in MemorySpace and on the host, and makes DocumentMasks over them.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class Documents {
 public:
  using view_type = Kokkos::View<index_type*, MemorySpace>;

  explicit Documents(const std::vector<index_type>& offsets)
      : m_device("blockattn::document_offsets", offsets.size()),
        m_host(Kokkos::create_mirror_view(m_device)) {
    for (std::size_t i = 0; i < offsets.size(); ++i) m_host(i) = offsets[i];
    check();
    Kokkos::deep_copy(m_device, m_host);
  }
  /// From offsets already in MemorySpace (copied once to the host).
  explicit Documents(const view_type& offsets)
      : m_device(offsets),
        m_host(Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), offsets)) {
    check();
  }

  int count() const { return static_cast<int>(m_host.extent(0)) - 1; }
  const view_type& offsets() const { return m_device; }

  /// Tokens see their own document: causal (default) or bidirectional, and
  /// k - q within [-left, right] (default unbounded).
  DocumentMask mask(bool causal = true, index_type left = std::numeric_limits<index_type>::max(),
                    index_type right = std::numeric_limits<index_type>::max()) const {
    DocumentMask m;
    m.host_offsets = m_host.data();
    m.device_offsets = m_device.data();
    m.documents = count();
    m.causal = causal;
    m.left = left;
    m.right = right;
    return m;
  }

 private:
  view_type m_device;
  decltype(Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(),
                                               std::declval<view_type>())) m_host;

  void check() const {
    const std::size_t n = m_host.extent(0);
    if (n < 2)
      impl::fail("Documents", "argument 'offsets' has ", n,
                 " entries, expected at least 2 (documents + 1, cu_seqlens-style)");
    for (std::size_t i = 1; i < n; ++i)
      if (!(m_host(i) > m_host(i - 1)))
        impl::fail("Documents", "argument 'offsets' is not strictly increasing: offsets[", i,
                   "] = ", m_host(i), " after offsets[", i - 1, "] = ", m_host(i - 1),
                   "; expected document starts in increasing order (empty documents are not "
                   "allowed)");
  }
};

}  // namespace blockattn
