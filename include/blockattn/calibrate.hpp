// SPDX-License-Identifier: Apache-2.0
// Forwarding header: the calibration of the planner's machine model lives in
// blockattn/plan/calibrate.hpp.
#pragma once

#include <blockattn/plan/calibrate.hpp>
