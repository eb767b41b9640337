// SPDX-License-Identifier: Apache-2.0
// Strict command-line values for the tools, benchmarks and examples: a value
// is a whole number (or a finite real) in a stated range, or the program
// stops with a message naming the flag, what it expected and what it got.
// std::atoi read "4x" as 4 and "x" as 0, which the programs then took as a
// setting ("--flops x" silently kept the preset, "--reps x" timed nothing).
// Not part of the library's headers: a source file of the executables.
#pragma once

#include <Kokkos_Core.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <vector>

namespace blockattn_cli {

/// `s` split at every `sep`; empty items are kept ("1,,2" has three), so that
/// a list with a stray separator is an error rather than a shorter list.
inline std::vector<std::string> split(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::size_t b = 0;
  for (;;) {
    const std::size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

/// The whole of `s` as an integer in [lo, hi] (decimal, optional sign).
inline bool parse_int(const std::string& s, long long& out, long long lo, long long hi) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0' || errno != 0 || v < lo || v > hi) return false;
  out = v;
  return true;
}

/// The whole of `s` as a finite real in [lo, hi] (1e9, 2.5e-6, ...).
inline bool parse_real(const std::string& s, double& out, double lo, double hi) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || errno != 0 || !std::isfinite(v) || v < lo || v > hi) return false;
  out = v;
  return true;
}

/// ">= 1", "in [0, 8]", ... (for messages).
inline std::string range_text(long long lo, long long hi) {
  if (hi == std::numeric_limits<long long>::max() || hi == std::numeric_limits<int>::max())
    return ">= " + std::to_string(lo);
  return "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

/// What is wrong with `value` as `flag`'s integer, or "" (and `out` set).
template <class Int>
std::string read_int(const std::string& flag, const std::string& value, Int& out, long long lo = 1,
                     long long hi = std::numeric_limits<Int>::max()) {
  long long v = 0;
  if (!parse_int(value, v, lo, hi))
    return flag + ": expected an integer " + range_text(lo, hi) + ", got '" + value + "'";
  out = static_cast<Int>(v);
  return "";
}

/// What is wrong with `value` as `flag`'s real, or "" (and `out` set).
/// `positive`: > 0, else >= 0.
inline std::string read_real(const std::string& flag, const std::string& value, double& out,
                             bool positive) {
  if (!parse_real(value, out, 0.0, std::numeric_limits<double>::max()) || (positive && !(out > 0)))
    return flag + ": expected a " + (positive ? "positive" : "non-negative") + " number, got '" +
           value + "'";
  return "";
}

/// What is wrong with `value` as `flag`'s comma-separated list of integers in
/// [lo, hi] (at least one), or "" (and `out` set).
template <class Int>
std::string read_int_list(const std::string& flag, const std::string& value, std::vector<Int>& out,
                          long long lo = 1, long long hi = std::numeric_limits<Int>::max()) {
  std::vector<Int> r;
  for (const std::string& item : split(value)) {
    long long v = 0;
    if (!parse_int(item, v, lo, hi))
      return flag + ": expected a comma-separated list of integers " + range_text(lo, hi) +
             ", got '" + value + "'";
    r.push_back(static_cast<Int>(v));
  }
  out = r;
  return "";
}

/// Whether the command line asks for the usage text (--help or -h). Checked
/// before Kokkos::initialize, which would print its own help for --help.
inline bool wants_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

/// Runs `body` (which returns the exit status); an exception escaping it
/// becomes one line on stderr, "program: what" (printed when `print`: rank 0
/// of an MPI program), and exit status 2, instead of std::terminate's abort.
template <class Body>
int run_guarded(const char* program, bool print, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    if (print) std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  return 2;
}

/// The start and end of a program's main, once: --help answered before
/// Kokkos starts (it has its own --help), Kokkos up, `body` run guarded
/// (run_guarded: `print` on rank 0 of an MPI program), Kokkos down. Returns
/// the exit status.
template <class Body>
int kokkos_main(int& argc, char** argv, const char* program, const char* usage, bool print,
                Body&& body) {
  if (wants_help(argc, argv)) {
    if (print) std::fputs(usage, stdout);
    return 0;
  }
  Kokkos::initialize(argc, argv);
  const int rc = run_guarded(program, print, body);
  Kokkos::finalize();
  return rc;
}

}  // namespace blockattn_cli
