// SPDX-License-Identifier: Apache-2.0
// Team scratch in cache-line aligned pieces.
//
// Kokkos' team scratch starts wherever the backend's pool puts it: Kokkos
// 3.4.1's OpenMP backend hands every team a base 48 bytes into a cache line
// (measured: address % 64 == 48 at both levels, all sizes). A 64-byte row of
// an AMX tile or an AVX-512 vector there straddles two lines. On a Sapphire
// Rapids Xeon an AMX 2 x 2 tile block (amx_block, 4 chunks, operands in L1)
// took 21.5 ns per tile product with its operands so placed and 13.6 ns
// aligned (1 thread); a tile load alone 17.5 ns against 2.7 ns. The kernels
// take their scratch through ScratchLines: one extra line is asked for and
// the first piece's address rounded up to a line; every piece is a whole
// number of lines.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstddef>
#include <cstdint>

namespace blockattn {
namespace impl {

/// The bytes of scratch lines a piece of `bytes` takes.
KOKKOS_INLINE_FUNCTION constexpr std::size_t scratch_line_bytes(std::size_t bytes) {
  return (bytes + 63) / 64 * 64;
}

/// What a team asks for to take pieces whose scratch_line_bytes sum to
/// `lines`: one line more, for the alignment of the first.
KOKKOS_INLINE_FUNCTION constexpr std::size_t scratch_request(std::size_t lines) {
  return lines + 64;
}

/// Cache-line aligned pieces of a team's scratch at one level: the caller's
/// policy asked for scratch_request(sum of the pieces' scratch_line_bytes).
class ScratchLines {
 public:
  template <class Member>
  KOKKOS_INLINE_FUNCTION ScratchLines(const Member& team, int level, std::size_t lines) {
    char* const base =
        static_cast<char*>(team.team_scratch(level).get_shmem(scratch_request(lines)));
    const std::size_t off = reinterpret_cast<std::uintptr_t>(base) % 64;
    next_ = base + (off == 0 ? 0 : 64 - off);
  }

  /// The next piece: `count` values of T on whole lines.
  template <class T>
  KOKKOS_INLINE_FUNCTION T* take(std::size_t count) {
    T* const p = reinterpret_cast<T*>(next_);
    next_ += scratch_line_bytes(sizeof(T) * count);
    return p;
  }

 private:
  char* next_ = nullptr;
};

/// Takes nothing and counts the lines that the same takes from a
/// ScratchLines would: one function that carves a team's pieces sizes them.
struct ScratchCount {
  std::size_t lines = 0;
  template <class T>
  KOKKOS_INLINE_FUNCTION T* take(std::size_t count) {
    lines += scratch_line_bytes(sizeof(T) * count);
    return nullptr;
  }
};

}  // namespace impl
}  // namespace blockattn
