#include "daemon/rl/store_events.h"

namespace refit::rl {

void TimelineEvents::OnVersionComplete(const std::string& model, uint64_t version) {
  timeline_->Mark(model, version, kStageComplete);
}

void TimelineEvents::OnVersionQuantized(const std::string& model, uint64_t version,
                                        double seconds) {
  const int64_t now = WallMicros();
  timeline_->Record(model, version, kStageQuantized, now - static_cast<int64_t>(seconds * 1e6), now,
                    "fp8 destinations");
}

}  // namespace refit::rl
