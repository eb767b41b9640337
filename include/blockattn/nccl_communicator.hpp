// SPDX-License-Identifier: Apache-2.0
// Forwarding header: NcclCommunicator lives in blockattn/comm/nccl_communicator.hpp
// (the only header that includes <nccl.h>; a Kokkos with CUDA; link BlockAttn::nccl).
#pragma once

#include <blockattn/comm/nccl_communicator.hpp>
