// SPDX-License-Identifier: Apache-2.0
// PyTorch's rates as bench/torch_sdpa.py --device cuda writes them, one line
// per case: "<fwd|bwd> N D <full|causal> dtype TFLOP/s backend". Read by the
// GPU benchmarks to print PyTorch's best backend next to ours. Not part of
// the library's headers: a source file of the executables.
#pragma once

#include <fstream>
#include <map>
#include <string>
#include <utility>

namespace blockattn_cli {

/// Key "op/N/D/mask/dtype" -> (TFLOP/s, backend); empty when the file is missing.
inline std::map<std::string, std::pair<double, std::string>> read_torch_rates(
    const std::string& path) {
  std::map<std::string, std::pair<double, std::string>> r;
  std::ifstream in(path);
  std::string op, mask, dtype, backend;
  int n = 0, d = 0;
  double t = 0;
  while (in >> op >> n >> d >> mask >> dtype >> t >> backend)
    r[op + "/" + std::to_string(n) + "/" + std::to_string(d) + "/" + mask + "/" + dtype] = {
        t, backend};
  return r;
}

}  // namespace blockattn_cli
