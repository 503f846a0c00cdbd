#pragma once

// refit's release version, shown by `refitd --version`, `refitctl --version` and Status: the
// top-level VERSION file, with "~dirty" when built from an unclean git tree
// (scripts/ship/version.sh). Defined in the generated version.cc (bazel/version.bzl), so a change
// of it relinks binaries without recompiling what includes this header.
namespace refit {
extern const char kRefitVersion[];
}  // namespace refit
