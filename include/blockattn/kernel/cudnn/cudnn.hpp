// SPDX-License-Identifier: Apache-2.0
// cuDNN's fused attention (SDPA) for one band piece: declarations only. The
// definitions (src/cudnn_attention.cpp, CMake target BlockAttn::cudnn) are
// the one translation unit that includes cuDNN's frontend headers, so that
// no user file pays for them. Built with -DBLOCKATTN_ENABLE_CUDNN (CMake
// option BLOCKATTN_ENABLE_CUDNN, on by default when CUDA Kokkos, cuDNN 9 and
// the frontend headers are found).
//
// Each distinct problem (shape, type, band, strides, scale) builds a cuDNN
// graph once per process and device and keeps it (thread-safe). The calls
// enqueue on the call's stream and return without synchronising.
#pragma once

#include <blockattn/kernel/fused.hpp>

#include <cstddef>
#include <string>

namespace blockattn::cudnn {

/// Whether cuDNN (the library this process loaded, on the current device)
/// runs this forward; otherwise false and, with `why`, cuDNN's reason.
bool supports_forward(const FusedForwardCall& call, std::string* why = nullptr);
/// Workspace bytes the forward needs (0 for most problems).
std::size_t forward_workspace(const FusedForwardCall& call);
/// Enqueues the forward. Throws blockattn::invalid_argument naming the call
/// and cuDNN's status text on failure.
void forward(const FusedForwardCall& call);

bool supports_backward(const FusedBackwardCall& call, std::string* why = nullptr);
std::size_t backward_workspace(const FusedBackwardCall& call);
void backward(const FusedBackwardCall& call);

/// cuDNN's version as cudnnGetVersion() reports it (e.g. 91900), 0 when no
/// library could be loaded.
long version();

}  // namespace blockattn::cudnn
