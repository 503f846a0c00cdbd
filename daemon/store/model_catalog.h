#pragma once

// What this node holds of each model, as reported to others (issue 38: the store split along
// its seams): the replica reporter (daemon/peer) reads it. Store implements it.

#include <vector>

#include "daemon/store/store_types.h"

namespace refit {

class ModelCatalog {
 public:
  virtual ~ModelCatalog() = default;

  // Every model this node knows: its versions, buffers and memory (ModelInfo).
  virtual std::vector<ModelInfo> Models() const = 0;
};

}  // namespace refit
