// SPDX-License-Identifier: Apache-2.0
// Umbrella header of BlockAttn.
#pragma once

#include <blockattn/allgather_schedule.hpp>
#include <blockattn/attention_backward.hpp>
#include <blockattn/attention_forward.hpp>
#include <blockattn/balanced_schedule.hpp>
#include <blockattn/communicator.hpp>
#include <blockattn/config.hpp>
#include <blockattn/distributed_attention.hpp>
#include <blockattn/document_mask.hpp>
#include <blockattn/errors.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/partition.hpp>
#include <blockattn/planner.hpp>
#include <blockattn/positions.hpp>
#include <blockattn/ring_schedule.hpp>
#include <blockattn/schedule.hpp>
#include <blockattn/tile_shape.hpp>
#include <blockattn/work.hpp>

// The MPI communicator is not included here (only it needs <mpi.h>):
// #include <blockattn/mpi_communicator.hpp>
