#pragma once

// --delta-base (issue 38: the store split along its seams): where an engine node takes the base
// a delta is applied to, per model. A value fixed at start (no lock: it never changes after
// the store is made); the store's --delta-base=destination machinery is store_delta_base.cc.

#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace refit {

// Where an engine node takes the base a delta is applied to (--delta-base): its held copy of
// the newest version (kHeld), or its own DESTINATION buffers, which the last Apply filled with
// that version (kDestination: the held copy is released once every destination holds it, so
// the node keeps 1 x the model plus the deltas; store_delta_base.cc).
enum class DeltaBase { kHeld, kDestination };

// Parses --delta-base / the config key delta_base: comma-separated items, each "held" or
// "destination" (every model not named) or MODEL=held|destination (that model), e.g.
// "destination", "policy=destination", "destination,critic=held". Not given: held.
// INVALID_ARGUMENT naming the item for an empty item, an unknown mode, two defaults or a model
// named twice.
absl::Status ParseDeltaBase(const std::string& text, DeltaBase* default_base,
                            std::map<std::string, DeltaBase>* per_model);
const char* DeltaBaseName(DeltaBase base);

// The mode of each model: `per_model`'s entry, else `default_base`.
class DeltaBaseModes {
 public:
  DeltaBaseModes(DeltaBase default_base, std::map<std::string, DeltaBase> per_model)
      : default_(default_base), per_model_(std::move(per_model)) {}
  DeltaBase Of(const std::string& model) const {
    auto it = per_model_.find(model);
    return it == per_model_.end() ? default_ : it->second;
  }

 private:
  const DeltaBase default_;
  const std::map<std::string, DeltaBase> per_model_;
};

}  // namespace refit
