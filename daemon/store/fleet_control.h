#pragma once

// Rolling a model back across the fleet and dropping it (issue 38: the store's client API split
// by job): what Rollback, Resume, WaitForReplicas' hold, DropModel and Status (daemon/server)
// need of the store beyond VersionHolds and ModelCatalog. Store implements it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/store/store_types.h"

namespace refit {

class FleetControl {
 public:
  virtual ~FleetControl() = default;
  // What Rollback would answer, changing nothing: OK when `version` is retained here.
  virtual absl::Status CheckRollback(const std::string& model, uint64_t version) const = 0;
  // The other nodes with SOURCE buffers of `model` (where a Rollback asked here is forwarded).
  virtual std::vector<std::string> SourceNodes(const std::string& model) const = 0;
  // Waits until the model's hold is `version` (0: none), up to `deadline`; false past it.
  virtual bool WaitForHold(const std::string& model, uint64_t version,
                           Clock::time_point deadline) = 0;
  // Releases every version of `model` held here and forgets it (Store::DropModel).
  virtual absl::StatusOr<DropResult> DropModel(const std::string& model) = 0;
};

}  // namespace refit
