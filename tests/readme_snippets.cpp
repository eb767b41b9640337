// SPDX-License-Identifier: Apache-2.0
// Build tool for test_readme.cpp: writes every ```cpp block of the given
// Markdown files (README.md and the docs pages, in this order) to
// <outdir>/readme_snippet_<i>.inc (i = 1, 2, ... across the files) and their
// count to <outdir>/readme_snippets.hpp, so that the documentation's code is
// compiled (and run) by the test suite and cannot drift from the library.
//
//   blockattn_readme_snippets <outdir> <file.md>...
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " outdir file.md...\n";
    return 2;
  }
  const std::string dir = argv[1];
  auto write = [&](const std::string& path, const std::string& text) {
    // Rewrite only on change, so that an unrelated edit rebuilds nothing.
    std::ifstream old(path);
    std::stringstream seen;
    seen << old.rdbuf();
    if (old && seen.str() == text) return true;
    std::ofstream out(path);
    out << text;
    return bool(out);
  };
  int count = 0;
  for (int f = 2; f < argc; ++f) {
    std::ifstream in(argv[f]);
    if (!in) {
      std::cerr << argv[0] << ": cannot read " << argv[f] << "\n";
      return 1;
    }
    // #line names the file as given (relative to the source tree).
    std::string name = argv[f];
    const std::string::size_type cut = name.rfind("/docs/");
    if (cut != std::string::npos)
      name = name.substr(cut + 1);
    else if (name.rfind('/') != std::string::npos)
      name = name.substr(name.rfind('/') + 1);
    std::string line, block;
    bool inside = false;
    int line_no = 0, first = 0;
    while (std::getline(in, line)) {
      ++line_no;
      if (!inside && line.rfind("```cpp", 0) == 0) {
        inside = true;
        block.clear();
        first = line_no + 1;
      } else if (inside && line.rfind("```", 0) == 0) {
        inside = false;
        ++count;
        const std::string text = "#line " + std::to_string(first) + " \"" + name + "\"\n" + block;
        if (!write(dir + "/readme_snippet_" + std::to_string(count) + ".inc", text)) return 1;
      } else if (inside) {
        block += line + "\n";
      }
    }
    if (inside) {
      std::cerr << argv[f] << ":" << first - 1 << ": unterminated ```cpp block\n";
      return 1;
    }
  }
  return write(dir + "/readme_snippets.hpp",
               "#define BLOCKATTN_README_SNIPPETS " + std::to_string(count) + "\n")
             ? 0
             : 1;
}
