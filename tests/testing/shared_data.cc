#include "tests/testing/shared_data.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace refit::testing {
namespace {

bool HasDeltas(const std::string& dir) {
  struct stat st;
  const std::string path = dir + "/data/deltas";
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

const char* EnvDir() {
  const char* env = std::getenv("REFIT_SHARED_DIR");
  return env != nullptr && *env != '\0' ? env : nullptr;
}

}  // namespace

std::string FindSharedDir() {
  if (const char* env = EnvDir()) return HasDeltas(env) ? env : "";
  std::vector<std::string> candidates;
  char resolved[PATH_MAX];
  // Under `bazel test` the working directory is the runfiles tree of the workspace "refit".
  for (const char* runfile : {"tests/testing/shared_data.h", "refit/tests/testing/shared_data.h"}) {
    if (realpath(runfile, resolved) != nullptr) {
      std::string path = resolved;  // <source tree>/tests/testing/shared_data.h
      for (int up = 0; up < 3; ++up) path = path.substr(0, path.rfind('/'));
      candidates.push_back(path + "/../shared");
    }
  }
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {  // `bazel run`
    candidates.push_back(std::string(ws) + "/../shared");
  }
  candidates.push_back("../shared");
  candidates.push_back("/work/shared");
  for (const std::string& candidate : candidates) {
    if (HasDeltas(candidate)) return candidate;
  }
  return "";
}

std::string SharedDirOrSkip(const std::string& what) {
  std::string dir = FindSharedDir();
  if (!dir.empty()) return dir;
  if (const char* env = EnvDir()) {
    FAIL("REFIT_SHARED_DIR=" << env << " has no data/deltas: cannot run " << what);
  }
  WARN(
      "shared data directory not found (set REFIT_SHARED_DIR, or clone next to shared/): "
      "SKIPPING "
      << what);
  return "";
}

}  // namespace refit::testing
