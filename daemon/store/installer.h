#pragma once

// Installing a version into an engine's memory and checking it (issue 38: the store's client
// API split by job): what Apply and Verify (daemon/server) need of the store. Store implements
// it; Store's declarations document both.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/store/store_types.h"

namespace refit {

class Installer {
 public:
  virtual ~Installer() = default;
  // Writes `version` (0: the model's target) into the listed DESTINATION buffers, all or
  // nothing.
  virtual absl::StatusOr<ApplyResult> Apply(const std::string& model, uint64_t version,
                                            const std::vector<std::string>& buffer_ids) = 0;
  // Compares each DESTINATION buffer of `model` with the version its last Apply installed.
  virtual absl::StatusOr<std::vector<VerifyResult>> Verify(const std::string& model) = 0;
};

}  // namespace refit
