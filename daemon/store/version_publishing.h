#pragma once

// A trainer's side of versions (issue 38: the store's client API split by job): what Publish
// (daemon/server) needs of the store. Store implements it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/store/store_types.h"

namespace refit {

class VersionPublishing {
 public:
  virtual ~VersionPublishing() = default;
  // Snapshots the listed SOURCE buffers as `version` of `model`, of the trainer's `run` (empty:
  // the model's current one); Store::Publish documents the checks.
  virtual absl::StatusOr<PublishResult> Publish(const std::string& model, uint64_t version,
                                                const std::vector<std::string>& buffer_ids,
                                                const std::string& run = "") = 0;
  // Seeds the model's current run and the runs it left (from --state-dir, at the model's
  // first Publish) without letting anything go.
  virtual void SeedRun(const std::string& model, const std::string& run,
                       const std::vector<std::string>& past_runs) = 0;
};

}  // namespace refit
