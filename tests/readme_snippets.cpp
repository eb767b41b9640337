// SPDX-License-Identifier: Apache-2.0
// Build tool for test_readme.cpp: writes every ```cpp block of README.md to
// <outdir>/readme_snippet_<i>.inc (i = 1, 2, ...) and their count to
// <outdir>/readme_snippets.hpp, so that the README's code is compiled (and run)
// by the test suite and cannot drift from the library.
//
//   blockattn_readme_snippets <README.md> <outdir>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " README.md outdir\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  if (!in) {
    std::cerr << argv[0] << ": cannot read " << argv[1] << "\n";
    return 1;
  }
  const std::string dir = argv[2];
  std::string line, block;
  bool inside = false;
  int count = 0, line_no = 0, first = 0;
  auto write = [&](const std::string& path, const std::string& text) {
    // Rewrite only on change, so that an unrelated README edit rebuilds nothing.
    std::ifstream old(path);
    std::stringstream seen;
    seen << old.rdbuf();
    if (old && seen.str() == text) return true;
    std::ofstream out(path);
    out << text;
    return bool(out);
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (!inside && line.rfind("```cpp", 0) == 0) {
      inside = true;
      block.clear();
      first = line_no + 1;
    } else if (inside && line.rfind("```", 0) == 0) {
      inside = false;
      ++count;
      const std::string text = "#line " + std::to_string(first) + " \"README.md\"\n" + block;
      if (!write(dir + "/readme_snippet_" + std::to_string(count) + ".inc", text)) return 1;
    } else if (inside) {
      block += line + "\n";
    }
  }
  if (inside) {
    std::cerr << argv[1] << ":" << first - 1 << ": unterminated ```cpp block\n";
    return 1;
  }
  return write(dir + "/readme_snippets.hpp",
               "#define BLOCKATTN_README_SNIPPETS " + std::to_string(count) + "\n")
             ? 0
             : 1;
}
