// SPDX-License-Identifier: Apache-2.0
// Umbrella header of BlockAttn.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/core/quant.hpp>
#include <blockattn/distributed/batch.hpp>
#include <blockattn/distributed/decode.hpp>
#include <blockattn/distributed/distributed_attention.hpp>
#include <blockattn/distributed/hybrid.hpp>
#include <blockattn/distributed/kv_cache.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/distributed/paged_kv_cache.hpp>
#include <blockattn/distributed/ulysses.hpp>
#include <blockattn/kernel/attention_backward.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/band.hpp>
#include <blockattn/kernel/block_implementation.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/decode.hpp>
#include <blockattn/kernel/decode_paged.hpp>
#include <blockattn/kernel/decode_quantized.hpp>
#include <blockattn/kernel/dispatch.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/plan/balance.hpp>
#include <blockattn/plan/decode.hpp>
#include <blockattn/plan/planner.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>
#include <blockattn/policy/table_partition.hpp>
#include <blockattn/schedule/allgather.hpp>
#include <blockattn/schedule/balanced.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/hybrid.hpp>
#include <blockattn/schedule/ring.hpp>
#include <blockattn/schedule/schedule.hpp>

// The MPI communicator is not included here (only it needs <mpi.h>):
// #include <blockattn/comm/mpi_communicator.hpp>   (or blockattn/mpi_communicator.hpp)
