#pragma once

// The shared data directory beside the checkout (../shared, holding data/deltas/: real
// successive bf16 weight versions), as every test that reads it finds it.
//
// $REFIT_SHARED_DIR, when set, is the only place looked at: scripts/test.sh (CI) always sets it,
// so data missing there fails the tests that need it. Unset (a developer's plain `bazel test`),
// the directory is looked for beside the source tree, and a test without it skips, saying so.
//
// Thread-safety: any thread (reads the environment and the file system only).

#include <string>

namespace refit::testing {

// The directory holding data/deltas/: $REFIT_SHARED_DIR when set (empty when it lacks
// data/deltas); else shared/ beside the source tree (found by resolving this library's runfile,
// a symlink into the source tree under `bazel test`), ../shared, or /work/shared. Empty when
// none holds data/deltas.
std::string FindSharedDir();

// FindSharedDir(), for a Catch2 test that reads the shared data. When it is not found: with
// $REFIT_SHARED_DIR set, FAILs the running test; else WARNs "shared data directory not found
// ...: SKIPPING <what>" and returns empty (the caller then skips).
std::string SharedDirOrSkip(const std::string& what);

}  // namespace refit::testing
