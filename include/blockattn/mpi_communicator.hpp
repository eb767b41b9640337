// SPDX-License-Identifier: Apache-2.0
// Forwarding header: MpiCommunicator lives in blockattn/comm/mpi_communicator.hpp
// (the only header that includes <mpi.h>; link BlockAttn::mpi).
#pragma once

#include <blockattn/comm/mpi_communicator.hpp>
