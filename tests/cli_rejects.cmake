# SPDX-License-Identifier: Apache-2.0
# ctest helper: runs PROG with ARGS ("|"-separated) and passes when it exits
# with status 2 and its stderr matches EXPECT (a regular expression): a bad
# command line must stop the program with a message that names the flag.
#   cmake -DPROG=... -DARGS="--p|4x" -DEXPECT="..." -P cli_rejects.cmake
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND "${PROG}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "${PROG} ${ARGS}: expected exit status 2, got '${rc}'\n${out}${err}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "${PROG} ${ARGS}: stderr does not match '${EXPECT}':\n${err}")
endif()
message(STATUS "rejected as expected: ${err}")
