// SPDX-License-Identifier: Apache-2.0
// Umbrella header of BlockAttn.
#pragma once

#include <blockattn/attention_forward.hpp>
#include <blockattn/config.hpp>
#include <blockattn/errors.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/positions.hpp>
#include <blockattn/tile_shape.hpp>
#include <blockattn/work.hpp>
