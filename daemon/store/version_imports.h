#pragma once

// Versions handed over whole (issue 38: the store split along its seams): what the bucket
// importer (daemon/bucket, --bucket-import) needs of the store. Store implements it; bucket/
// depends on //daemon/store:version_imports, not on the store.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/memory/region.h"
#include "daemon/store/store_types.h"

namespace refit {

class VersionImports {
 public:
  virtual ~VersionImports() = default;

  // A slot of `size` bytes to build an imported version's piece in, counted against the
  // budget of the model being pulled or imported with a piece of that size (the same slots as
  // PullLanding::AcquireSlot).
  virtual absl::StatusOr<std::shared_ptr<Region>> AcquireSlot(uint64_t size) = 0;
  // `node` (e.g. a storage bucket being followed) hands over `version` of `model` whole: its
  // SOURCE layouts and, per layout, a slot holding every byte. The version completes here as
  // if pulled from a peer (once any local sources published it too); `slots` are kept as the
  // version's pieces.
  virtual void ImportVersion(const std::string& node, const std::string& model, uint64_t version,
                             std::vector<SourceLayout> layouts,
                             std::vector<std::shared_ptr<Region>> slots) = 0;
};

}  // namespace refit
