// SPDX-License-Identifier: Apache-2.0
// Sums whose bits do not depend on the order of their terms: the accumulators
// of the invariant mode (ForwardOptions::invariant, kernel/invariant/).
//
// Pre-rounding into fixed bins (Rump, Ogita and Oishi's ExtractVector;
// Demmel and Nguyen's reproducible summation, ReproBLAS): a row fixes an
// exponent e with every term's and every partial sum's magnitude below
// 2^(e + 31) (e from a bound of the row's |V| and at most 2^31 terms). A term
// x is cut into three pieces on fixed grids,
//
//   q1 = fl(fl(M1 + x) - M1),  x1 = x - q1,   M1 = 1.5 * 2^(e + 33), grid 2^(e - 19)
//   q2 = fl(fl(M2 + x1) - M2), x2 = x1 - q2,  M2 = 1.5 * 2^(e + 13), grid 2^(e - 39)
//   q3 = fl(fl(M3 + x2) - M3),                M3 = 1.5 * 2^(e - 7),  grid 2^(e - 59)
//
// each of which is exact (M + x stays in M's binade, Sterbenz for the
// subtraction, and the remainders are representable), and fold k adds its
// pieces in fp64. A fold's sum is a multiple of its grid smaller than 52 bits
// of it, so every addition into it is exact: the folds hold the exact sums of
// their pieces whatever the order of the terms, the partition of the work or
// the ranks that added them (two folds of the same e add exactly too: MPI_SUM
// of them is order-free). What is lost is below 2^(e - 60) per term (x - q1 -
// q2 - q3), far under the fp32 rounding of the terms themselves.
//
// Needs value-safe floating point (the defaults of GCC, Clang, nvcc, hipcc):
// a compiler allowed to reassociate (-ffast-math, icx's default fp-model)
// folds (M + x) - M into x.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/impl/exp2.hpp>

#include <cstdint>

namespace blockattn::impl {

/// The fold arithmetic (3 folds).
struct InvariantFolds {
  static constexpr int folds = 3;

  /// e with |x| < 2^e for every finite float |x| <= bound (bound >= 0 finite):
  /// the biased exponent of the bound less 126 (denormals and 0 give -126).
  KOKKOS_INLINE_FUNCTION static int exponent_of(float bound) {
    const std::uint32_t biased = (bit_cast<std::uint32_t>(bound) >> 23) & 0xffu;
    return int(biased == 0 ? 1u : biased) - 126;
  }

  /// 2^k in fp64, -1022 <= k <= 1023.
  KOKKOS_INLINE_FUNCTION static double pow2(int k) {
    return bit_cast<double>(std::uint64_t(k + 1023) << 52);
  }

  /// Adds the finite x (|x| and every partial sum < 2^(e + 31)) to the folds
  /// f[0], f[stride], f[2 stride].
  KOKKOS_INLINE_FUNCTION static void deposit(double* f, int stride, double x, int e) {
    double m = 1.5 * pow2(e + 33);
    double q = (m + x) - m;
    f[0] += q;
    x -= q;
    m = 1.5 * pow2(e + 13);
    q = (m + x) - m;
    f[stride] += q;
    x -= q;
    m = 1.5 * pow2(e - 7);
    q = (m + x) - m;
    f[2 * stride] += q;
  }

  /// deposit() of x[d], d < n, into the folds f[d], f[n + 1 + d], f[2 (n +
  /// 1) + d] (a row of n + 1 columns) with one e; a non-finite x[d] is added
  /// to nf[d] instead (and 0 to the folds, which adds nothing). Branch-free:
  /// the columns run as vectors.
  KOKKOS_INLINE_FUNCTION static void deposit_row(double* KOKKOS_RESTRICT f,
                                                 float* KOKKOS_RESTRICT nf,
                                                 const float* KOKKOS_RESTRICT x, int n, int e) {
    const int stride = n + 1;
    double* KOKKOS_RESTRICT f1 = f + stride;
    double* KOKKOS_RESTRICT f2 = f + 2 * stride;
    const double m0 = 1.5 * pow2(e + 33), m1 = 1.5 * pow2(e + 13), m2 = 1.5 * pow2(e - 7);
    for (int d = 0; d < n; ++d) {
      // Finite x to the folds, inf or NaN to nf (+0 to the other): masks on
      // the bits, no branch.
      const std::uint32_t u = bit_cast<std::uint32_t>(x[d]);
      const std::uint32_t keep = 0u - std::uint32_t((u & 0x7f800000u) != 0x7f800000u);
      nf[d] += bit_cast<float>(u & ~keep);
      double y = double(bit_cast<float>(u & keep));
      double q = (m0 + y) - m0;
      f[d] += q;
      y -= q;
      q = (m1 + y) - m1;
      f1[d] += q;
      y -= q;
      q = (m2 + y) - m2;
      f2[d] += q;
    }
  }

  /// The folds' value: smallest first (one fixed order).
  KOKKOS_INLINE_FUNCTION static double value(const double* f, int stride) {
    return f[0] + (f[stride] + f[2 * stride]);
  }
};

}  // namespace blockattn::impl
