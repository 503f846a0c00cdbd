#pragma once

// The store's events a version's timeline records (rl::Timeline): "quantized" and "complete".
//
// Thread-safety: the store calls it under its lock; Timeline::Record only takes its own.

#include <string>

#include "daemon/rl/timeline.h"
#include "daemon/store/store_types.h"

namespace refit::rl {

class TimelineEvents final : public StoreEvents {
 public:
  explicit TimelineEvents(Timeline* timeline) : timeline_(timeline) {}

  void OnVersionComplete(const std::string& model, uint64_t version) override;
  void OnVersionQuantized(const std::string& model, uint64_t version, double seconds) override;

 private:
  Timeline* const timeline_;  // not owned
};

}  // namespace refit::rl
