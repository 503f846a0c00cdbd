#pragma once

// An engine's view of versions as they complete (issue 38: the store's client API split by
// job): what WaitForVersion, Watch and Status (daemon/server) need of the store. Store
// implements it; Store's declarations document each method.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/store/store_types.h"

namespace refit {

class VersionWaits {
 public:
  virtual ~VersionWaits() = default;
  // Blocks until the model's target (its hold, else its newest complete version) is
  // >= min_version, or its run moved, or its hold is another version than `applied` (non-zero).
  virtual absl::StatusOr<VersionTarget> WaitForTarget(const std::string& model,
                                                      uint64_t min_version, const std::string& run,
                                                      Clock::time_point deadline,
                                                      const CancelledFn& cancelled,
                                                      uint64_t applied = 0) = 0;
  // Where a Watch of `model` starts (0: live events only).
  virtual uint64_t WatchCursor(const std::string& model, uint64_t after_version) const = 0;
  // Blocks until events after `*cursor` exist, returns them and moves the cursor past them.
  virtual absl::StatusOr<std::vector<VersionTarget>> WaitForEvents(
      const std::string& model, uint64_t* cursor, Clock::time_point deadline,
      const CancelledFn& cancelled) = 0;
  // Newest complete version of `model`, 0 if none (or no such model).
  virtual uint64_t LatestVersion(const std::string& model) const = 0;
};

}  // namespace refit
