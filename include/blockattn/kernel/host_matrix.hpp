// SPDX-License-Identifier: Apache-2.0
// The host matrix engine's setting and status (the engine: kernel/host/amx.hpp;
// host_matrix_engine() is defined there).
#pragma once

#include <string>

namespace blockattn {

/// Whether bf16 forwards and backwards on host spaces may run on the host's
/// matrix engine:
///  - automatic: AMX tile products where the CPU, the OS and
///    BLOCKATTN_HOST_MATRIX allow them; on CPUs without AMX, AVX512-BF16
///    vector products where they run faster than the fp32 kernels (AMD Zen 4
///    and later; BLOCKATTN_HOST_MATRIX=avx512bf16: the vectors on any CPU that
///    has them, =amx: AMX only);
///  - off: the fp32 kernels (P not rounded to bf16: the fp32 kernels' result
///    rounded once, the same bits on every machine);
///  - avx512_bf16: the AVX512-BF16 vector products where the CPU has them
///    (Zen 4, Cooper Lake, AMX CPUs), the fp32 kernels elsewhere: the same
///    kernel and numerics as AMX. On Intel CPUs they run at the fp32 FMA rate
///    (measured slower than the fp32 kernels there), which is why automatic
///    takes them on AMD's CPUs only.
enum class HostMatrix : int { automatic = 0, off = 1, avx512_bf16 = 2 };

/// What the host matrix engine is here: `amx` where AMX tile products run
/// (HostMatrix::automatic's engine), `avx512_bf16` where AVX512-BF16 vector
/// products run (HostMatrix::avx512_bf16's; automatic's too when
/// `vector_by_default`: on a CPU without AMX where they pay, or
/// BLOCKATTN_HOST_MATRIX=avx512bf16); `reason` says why automatic runs neither.
struct HostMatrixEngine {
  bool amx = false;
  bool avx512_bf16 = false;
  bool vector_by_default = false;
  std::string reason;
  /// The engine HostMatrix::automatic runs: "amx-bf16", "avx512-bf16" or "none".
  const char* name() const {
    return amx ? "amx-bf16" : vector_by_default && avx512_bf16 ? "avx512-bf16" : "none";
  }
};

}  // namespace blockattn
