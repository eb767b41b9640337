// SPDX-License-Identifier: Apache-2.0
// Host staging buffers for communicators that move device memory through the
// host (MpiCommunicator<HostStaged>): page-locked (pinned) buffers where the
// device has them (CUDA, HIP), so that the copies run at the link's rate
// and on the instance's stream; kept between messages and reused, so that a
// schedule's steady state allocates nothing (a buffer per message, pageable
// and touched for the first time, cost more than the copy itself).
#pragma once

#include <blockattn/core/config.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace blockattn {

/// What a communicator's staging buffers did (StagingPool::stats()).
struct StagingStats {
  std::int64_t allocations = 0;  // buffers allocated
  std::int64_t reuses = 0;       // messages served by a kept buffer
  std::int64_t kept = 0;         // buffers kept now (free for the next message)
  std::int64_t kept_bytes = 0;   // their bytes
};

namespace impl {

/// The host memory space staging buffers for data in MemSpace live in.
template <class MemSpace>
struct staging_space {
  using type = Kokkos::HostSpace;
};
#if defined(KOKKOS_ENABLE_CUDA)
template <>
struct staging_space<Kokkos::CudaSpace> {
  using type = Kokkos::CudaHostPinnedSpace;
};
#endif
#if defined(KOKKOS_ENABLE_HIP)
#if KOKKOS_VERSION >= 40000
template <>
struct staging_space<Kokkos::HIPSpace> {
  using type = Kokkos::HIPHostPinnedSpace;
};
#else
template <>
struct staging_space<Kokkos::Experimental::HIPSpace> {
  using type = Kokkos::Experimental::HIPHostPinnedSpace;
};
#endif
#endif
template <class MemSpace>
using staging_space_t = typename staging_space<MemSpace>::type;

/// Buffers of host memory spaces, handed out for one message and taken back
/// when its last handle goes: the smallest kept buffer that fits, else a new
/// one (rounded up to 64 KiB); at most `max_kept` buffers are kept (the
/// smallest freed first). Thread-safe. Buffers kept when Kokkos is
/// finalized are not freed (Kokkos cannot free them then).
class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  explicit StagingPool(std::size_t max_kept = 16) : m_max_kept(max_kept) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool() {
    for (const Entry& e : m_free) release(e);
  }

  /// A buffer of at least `bytes` bytes in host memory space Space.
  template <class Space>
  std::shared_ptr<char> acquire(std::size_t bytes) {
    Entry got{nullptr, 0, &free_in<Space>};
    {
      std::lock_guard<std::mutex> lock(m_mutex);
      auto best = m_free.end();
      for (auto it = m_free.begin(); it != m_free.end(); ++it)
        if (it->free == got.free && it->bytes >= bytes &&
            (best == m_free.end() || it->bytes < best->bytes))
          best = it;
      if (best != m_free.end()) {
        got = *best;
        m_free.erase(best);
        ++m_stats.reuses;
      }
    }
    if (got.ptr == nullptr) {
      constexpr std::size_t granule = std::size_t(1) << 16;
      got.bytes = std::max<std::size_t>(granule, (bytes + granule - 1) / granule * granule);
      got.ptr = Kokkos::kokkos_malloc<Space>("blockattn::staging", got.bytes);
      std::lock_guard<std::mutex> lock(m_mutex);
      ++m_stats.allocations;
    }
    std::shared_ptr<StagingPool> self = shared_from_this();
    return std::shared_ptr<char>(static_cast<char*>(got.ptr),
                                 [self, got](char*) { self->give_back(got); });
  }

  StagingStats stats() const {
    std::lock_guard<std::mutex> lock(m_mutex);
    StagingStats s = m_stats;
    s.kept = std::int64_t(m_free.size());
    for (const Entry& e : m_free) s.kept_bytes += std::int64_t(e.bytes);
    return s;
  }

 private:
  struct Entry {
    void* ptr;
    std::size_t bytes;
    void (*free)(void*);  // kokkos_free in the buffer's space: also names the space
  };
  template <class Space>
  static void free_in(void* p) {
    Kokkos::kokkos_free<Space>(p);
  }
  static void release(const Entry& e) {
    if (Kokkos::is_initialized()) e.free(e.ptr);
  }
  void give_back(const Entry& e) {
    std::vector<Entry> drop;
    {
      std::lock_guard<std::mutex> lock(m_mutex);
      m_free.push_back(e);
      while (m_free.size() > m_max_kept) {
        auto smallest =
            std::min_element(m_free.begin(), m_free.end(),
                             [](const Entry& a, const Entry& b) { return a.bytes < b.bytes; });
        drop.push_back(*smallest);
        m_free.erase(smallest);
      }
    }
    for (const Entry& d : drop) release(d);
  }

  std::size_t m_max_kept;
  mutable std::mutex m_mutex;
  std::vector<Entry> m_free;
  StagingStats m_stats;
};

}  // namespace impl
}  // namespace blockattn
