#pragma once

// Holding a model back to a version and letting it go (issue 38: the store split along its
// seams): what a peer's Rollback / Resume forwarded here (daemon/peer) and the Subscribe stream's
// `rollback_version` need of the store. Store implements it.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit {

class VersionHolds {
 public:
  virtual ~VersionHolds() = default;

  // Holds `model` back to `version` here: it must be a retained complete version (NOT_FOUND
  // naming the oldest retained otherwise; NOT_FOUND for an unknown model). Watch delivers it
  // as a rollback event, WaitForVersion and Apply(0) answer it, and newer versions complete
  // (into retention) without being delivered until Resume. Another Rollback moves the target.
  virtual absl::StatusOr<uint64_t> Rollback(const std::string& model, uint64_t version) = 0;
  // Ends the hold: the newest complete version is the target again (delivered by Watch when
  // it differs). FAILED_PRECONDITION when the model is not held back here.
  virtual absl::Status Resume(const std::string& model) = 0;
  // The version `model` is held back to here; 0: none.
  virtual uint64_t HoldOf(const std::string& model) const = 0;
};

}  // namespace refit
