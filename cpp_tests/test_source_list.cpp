// csrc/sources.txt, the one source list setup.py and CMakeLists.txt build from: every translation
// unit of csrc/ is in it (but the Python module entry, which setup.py adds), and every entry
// exists. A unit added to csrc/ and not listed would otherwise be left out of both builds.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace fs = std::filesystem;

namespace {

// By the rule setup.py and CMakeLists.txt read it: one path a line, blank and '#' lines skipped.
std::set<std::string> listed_sources(const fs::path& list) {
  std::set<std::string> out;
  std::ifstream in(list);
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    const auto last = line.find_last_not_of(" \t\r");
    out.insert(line.substr(first, last - first + 1));
  }
  return out;
}

}  // namespace

TEST(SourceList, ListsEveryTranslationUnitOfCsrc) {
  const fs::path csrc = SAGE_CSRC_DIR;
  const std::set<std::string> listed = listed_sources(csrc / "sources.txt");
  ASSERT_FALSE(listed.empty());
  std::set<std::string> found;
  for (const auto& entry : fs::recursive_directory_iterator(csrc)) {
    const auto ext = entry.path().extension();
    if (entry.is_regular_file() && (ext == ".cu" || ext == ".cpp"))
      found.insert(entry.path().lexically_relative(csrc).generic_string());
  }
  EXPECT_EQ(found.erase("torch/module.cpp"), 1u);  // the Python module: setup.py's alone
  EXPECT_EQ(found.erase("torch/call_cache.cpp"), 1u);
  EXPECT_EQ(found, listed);
}
