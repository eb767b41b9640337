// SPDX-License-Identifier: Apache-2.0
// The exception thrown for bad arguments, and the host-side checks that build
// its message: every message names the function, the argument and what was expected.
#pragma once

#include <blockattn/core/config.hpp>

#include <sstream>
#include <stdexcept>
#include <string>

namespace blockattn {

/// Thrown on bad input before any kernel runs.
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace impl {

template <class... Parts>
[[noreturn]] void fail(const char* function, Parts&&... parts) {
  std::ostringstream msg;
  msg << "blockattn::" << function << ": ";
  (msg << ... << parts);
  throw invalid_argument(msg.str());
}

/// `arg` extent `dim` (named `what`) must equal `expected` (described by `expected_from`).
template <class View>
void require_extent(const char* function, const char* arg, const View& view, int dim,
                    const char* what, std::size_t expected, const char* expected_from) {
  if (view.extent(dim) != expected)
    fail(function, "argument '", arg, "' has extent(", dim, ") (", what, ") = ", view.extent(dim),
         ", expected ", expected, " (", expected_from, ")");
}

template <class View>
void require_positive_extent(const char* function, const char* arg, const View& view, int dim,
                             const char* what) {
  if (view.extent(dim) == 0)
    fail(function, "argument '", arg, "' has extent(", dim, ") (", what,
         ") = 0, expected a positive size");
}

/// Memory space check. Compile-time information, reported at run time so that
/// the message names the argument; on a host-only build every View passes.
template <class ExecSpace, class MemorySpace>
void require_accessible(const char* function, const char* arg) {
  if (!Kokkos::SpaceAccessibility<ExecSpace, MemorySpace>::accessible)
    fail(function, "argument '", arg, "' lives in memory space ", MemorySpace::name(),
         ", which execution space ", ExecSpace::name(),
         " cannot access; expected a View in a memory space accessible from ", ExecSpace::name(),
         " (e.g. ", ExecSpace::memory_space::name(), ")");
}

}  // namespace impl
}  // namespace blockattn
