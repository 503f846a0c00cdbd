#pragma once

// Test helper: a fresh directory under $TEST_TMPDIR (or /tmp), removed with everything in it
// when the TempDir goes. Not thread-safe.

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>

#include "catch2/catch.hpp"

namespace refit::bucket::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "bucket") {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/" + prefix + ".XXXXXX";
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    nftw(
        path_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return remove(path); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace refit::bucket::testing
