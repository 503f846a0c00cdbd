#pragma once

// A version's timeline on this node: each stage it went through here (published, announced,
// pulled from whom, verified, quantized, complete, applied by whom) with wall-clock times, so
// that `refitctl timeline` can gather every node's and draw where a version was held back.
// Bounded: the newest kKeepVersions versions per model, kMaxStages stages per version, and
// kMaxModels models (a model past it is not recorded).
//
// Times are the wall clock (microseconds since the Unix epoch): nodes' timelines are compared
// with each other, as good as their clocks agree (NTP: a millisecond or so).
//
// Thread-safety: every method may be called from any thread; Record takes a short lock of its
// own and never calls out, so it may be called under other components' locks (the store's
// events).

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"

namespace refit::rl {

// The stage names (TimelineStage.stage).
inline constexpr char kStagePublished[] = "published";  // a Publish call snapshotting it here
inline constexpr char kStageAnnounced[] = "announced";  // announced by / to another node (detail)
inline constexpr char kStagePulled[] = "pulled";        // its bytes pulled (detail: from whom)
inline constexpr char kStageVerified[] = "verified";    // the pulled bytes checked (XXH3)
inline constexpr char kStageQuantized[] = "quantized";  // fp8 destinations' blocks quantized
inline constexpr char kStageComplete[] = "complete";    // visible to WaitForVersion, Watch, Apply
inline constexpr char kStageApplied[] = "applied";      // an Apply wrote it (detail: by whom)
inline constexpr char kStageRelayed[] = "relayed";      // served, as it pulled it, to a node

// Microseconds since the Unix epoch, now.
int64_t WallMicros();
// The wall-clock time of a steady-clock time point (as far as now is from it).
int64_t WallMicros(std::chrono::steady_clock::time_point t);

struct StageRecord {
  std::string stage;
  int64_t start_us = 0;
  int64_t end_us = 0;  // == start_us: a point in time
  std::string detail;
};

struct VersionRecord {
  uint64_t version = 0;
  std::vector<StageRecord> stages;  // by start time (stable: then in the order recorded)
};

class Timeline {
 public:
  static constexpr size_t kKeepVersions = 8;
  static constexpr size_t kMaxStages = 64;
  static constexpr size_t kMaxModels = 1024;
  static constexpr size_t kMaxDetailBytes = 256;

  // `version` of `model` went through `stage` from `start_us` to `end_us` here. A second
  // record of the same stage with the same detail is dropped (e.g. an announcement repeated).
  void Record(const std::string& model, uint64_t version, const std::string& stage,
              int64_t start_us, int64_t end_us, const std::string& detail = "");
  // A point in time: now.
  void Mark(const std::string& model, uint64_t version, const std::string& stage,
            const std::string& detail = "");
  // `version` of `model` (0: every version kept), oldest first, each's stages by start time.
  std::vector<VersionRecord> Get(const std::string& model, uint64_t version = 0) const;

 private:
  mutable common::Mutex mu_;
  std::map<std::string, std::map<uint64_t, std::vector<StageRecord>>> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::rl
