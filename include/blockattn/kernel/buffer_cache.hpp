// SPDX-License-Identifier: Apache-2.0
// Host memory that the single-device calls keep between calls for their
// packed blocks (K/V, the backward's query side, dQ accumulators).
//
// attention_forward and attention_backward pack their operands into buffers
// of about the size of K and V (and Q, dO on the backward) on every call.
// Fresh memory from the allocator costs a page fault per 4 KiB on first touch,
// and glibc hands large blocks back to the system on free: at N = 1024 that
// was 10-20 % of a forward on 2 threads (docs/history/measurements.md). So on host
// execution spaces each call takes one buffer from a per-memory-space cache,
// carves its blocks from it, and returns it (grown to what the call needed,
// up to the limit) at the end. Calls from several threads at once are safe:
// a call that finds the cache taken allocates as before. Device spaces
// allocate per call as before (their kernels run asynchronously on streams).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/kernel/tile_shape.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace blockattn {

namespace impl {

/// BLOCKATTN_BUFFER_CACHE_MB's value (`text`: MiB, a whole number >= 0) in
/// bytes; throws blockattn::invalid_argument naming the variable otherwise.
inline std::size_t parse_buffer_cache_mb(const char* text) {
  const std::string s = text != nullptr ? text : "";
  bool digits = !s.empty() && s.size() <= 9;
  for (char c : s) digits = digits && c >= '0' && c <= '9';
  if (!digits)
    fail("buffer_cache_limit", "environment variable BLOCKATTN_BUFFER_CACHE_MB is \"", s,
         "\"; expected a whole number of MiB (0 turns the cache off)");
  return std::size_t(std::stoul(s)) << 20;
}

/// The default of buffer_cache_limit(): a sixteenth of the machine's
/// physical memory, at least 64 MiB and at most 4 GiB (64 MiB where the
/// size is unknown), or BLOCKATTN_BUFFER_CACHE_MB. The packed blocks of a
/// call are about the size of its K and V: a prefill chunk of 32 bf16 rows
/// against a 131 072-token shard (2 kv heads, D = 128) needs ~130 MiB, and
/// allocating them per call (fresh pages, a fault per 4 KiB) made it 1.5x
/// slower on a 2-core Zen 4 than with them cached (a bf16 backward at H = 16,
/// N = 4096: 1.1-1.2x).
inline std::size_t default_buffer_cache_limit() {
  if (const char* env = std::getenv("BLOCKATTN_BUFFER_CACHE_MB")) return parse_buffer_cache_mb(env);
  constexpr std::size_t lo = std::size_t(64) << 20, hi = std::size_t(4) << 30;
  std::size_t physical = 0;
#if defined(__unix__) || defined(__APPLE__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) physical = std::size_t(pages) * std::size_t(page);
#endif
  const std::size_t share = physical / 16;
  return share < lo ? lo : share > hi ? hi : share;
}

struct BufferCacheRegistry {
  std::mutex mu;
  std::size_t limit = default_buffer_cache_limit();
  std::vector<std::function<void()>> release;  // one per memory space in use
};

inline BufferCacheRegistry& buffer_cache_registry() {
  static BufferCacheRegistry r;
  return r;
}

/// The one cached buffer of a memory space.
template <class MemorySpace>
struct SpaceBufferCache {
  using bytes_view = Kokkos::View<unsigned char*, MemorySpace>;
  std::mutex mu;
  bytes_view buffer;
  bool finalize_hook = false;  // a Kokkos finalize hook frees `buffer`
  bool registered = false;     // listed in buffer_cache_registry().release
};

template <class MemorySpace>
SpaceBufferCache<MemorySpace>& space_buffer_cache() {
  static SpaceBufferCache<MemorySpace> c;
  return c;
}

template <class MemorySpace>
void release_space_buffer() {
  auto& c = space_buffer_cache<MemorySpace>();
  typename SpaceBufferCache<MemorySpace>::bytes_view gone;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    gone = std::move(c.buffer);
    c.buffer = {};
  }
}

}  // namespace impl

/// Most bytes of host memory one memory space keeps cached between the
/// single-device calls (default: a sixteenth of physical memory, 64 MiB to
/// 4 GiB, or the environment variable BLOCKATTN_BUFFER_CACHE_MB; a call that
/// needs more allocates and frees its blocks as it goes). Throws
/// blockattn::invalid_argument when BLOCKATTN_BUFFER_CACHE_MB is not a whole
/// number.
inline std::size_t buffer_cache_limit() {
  auto& r = impl::buffer_cache_registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.limit;
}

/// Sets buffer_cache_limit() and frees the cached buffers now; 0 turns the
/// cache off. The cached buffers are also freed by Kokkos::finalize().
inline void set_buffer_cache_limit(std::size_t bytes) {
  std::vector<std::function<void()>> release;
  {
    auto& r = impl::buffer_cache_registry();
    const std::lock_guard<std::mutex> lock(r.mu);
    r.limit = bytes;
    release = r.release;
  }
  for (const auto& f : release) f();
}

namespace impl {

/// The buffers of one call on `exec`: views carved from the cached buffer of
/// the memory space (host spaces), or allocated one by one when it is taken,
/// too small or the space is a device's. Views from view() must not outlive
/// this object. The destructor fences `exec` and returns the buffer, grown
/// to the call's total when that is within buffer_cache_limit().
template <class ExecSpace>
class CallBuffers {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using bytes_view = Kokkos::View<unsigned char*, memory_space>;
  static constexpr std::size_t alignment = 64;

  explicit CallBuffers(const ExecSpace& exec) : m_exec(exec) {
    if constexpr (is_host_space_v<ExecSpace>) {
      m_cached = true;
      auto& c = space_buffer_cache<memory_space>();
      const std::lock_guard<std::mutex> lock(c.mu);
      m_buffer = std::move(c.buffer);
      c.buffer = {};
    }
  }
  CallBuffers(const CallBuffers&) = delete;
  CallBuffers& operator=(const CallBuffers&) = delete;

  /// An uninitialised LayoutRight View (no padding) of extents n...
  template <class View, class... Sizes>
  View view(const char* label, Sizes... n) {
    static_assert(std::is_same<typename View::array_layout, Kokkos::LayoutRight>::value,
                  "BlockAttn: CallBuffers carves LayoutRight Views");
    std::size_t elems = 1;
    for (std::size_t e : {std::size_t(n)...}) elems *= e;
    const std::size_t bytes = elems * sizeof(typename View::value_type);
    const std::size_t padded = (bytes + alignment - 1) / alignment * alignment;
    m_needed += padded;
    if (m_buffer.data() != nullptr && m_used + padded <= m_buffer.extent(0)) {
      auto* p = reinterpret_cast<typename View::value_type*>(m_buffer.data() + m_used);
      m_used += padded;
      return View(p, std::size_t(n)...);
    }
    return View(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                std::size_t(n)...);
  }

  ~CallBuffers() {
    if (!m_cached) return;
    try {
      m_exec.fence();
      std::size_t limit;
      {
        auto& r = buffer_cache_registry();
        const std::lock_guard<std::mutex> lock(r.mu);
        limit = r.limit;
      }
      if (m_needed > m_buffer.extent(0)) {
        m_buffer = bytes_view();
        if (m_needed <= limit)
          m_buffer = bytes_view(
              Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::buffer_cache"), m_needed);
      }
      if (m_buffer.extent(0) > limit) m_buffer = bytes_view();
      if (m_buffer.data() == nullptr) return;
      register_space();
      auto& c = space_buffer_cache<memory_space>();
      const std::lock_guard<std::mutex> lock(c.mu);
      if (!c.finalize_hook) {
        Kokkos::push_finalize_hook([] {
          release_space_buffer<memory_space>();
          auto& cc = space_buffer_cache<memory_space>();
          const std::lock_guard<std::mutex> l(cc.mu);
          cc.finalize_hook = false;
        });
        c.finalize_hook = true;
      }
      // Keep the larger of ours and one another call returned meanwhile.
      if (c.buffer.extent(0) < m_buffer.extent(0)) std::swap(c.buffer, m_buffer);
    } catch (...) {
      // Out of memory for the cache: the next call allocates as it goes.
    }
  }

 private:
  static void register_space() {
    auto& c = space_buffer_cache<memory_space>();
    {
      const std::lock_guard<std::mutex> lock(c.mu);
      if (c.registered) return;
      c.registered = true;
    }
    auto& r = buffer_cache_registry();
    const std::lock_guard<std::mutex> lock(r.mu);
    r.release.push_back(&release_space_buffer<memory_space>);
  }

  ExecSpace m_exec;
  bytes_view m_buffer;
  std::size_t m_used = 0, m_needed = 0;
  bool m_cached = false;
};

/// No CallBuffers: allocate_view allocates.
struct NoCallBuffers {};

/// An uninitialised LayoutRight View of extents n...: carved from `buffers`
/// when given, else allocated.
template <class View, class Buffers, class... Sizes>
View allocate_view(Buffers* buffers, const char* label, Sizes... n) {
  if constexpr (!std::is_same<Buffers, NoCallBuffers>::value)
    if (buffers != nullptr) return buffers->template view<View>(label, n...);
  return View(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
              std::size_t(n)...);
}

}  // namespace impl

}  // namespace blockattn
