#include "daemon/rl/timeline.h"

#include <algorithm>

namespace refit::rl {

int64_t WallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t WallMicros(std::chrono::steady_clock::time_point t) {
  const auto ago = std::chrono::steady_clock::now() - t;
  return WallMicros() - std::chrono::duration_cast<std::chrono::microseconds>(ago).count();
}

void Timeline::Record(const std::string& model, uint64_t version, const std::string& stage,
                      int64_t start_us, int64_t end_us, const std::string& detail) {
  if (version == 0) return;
  StageRecord record{stage, start_us, std::max(start_us, end_us),
                     detail.substr(0, kMaxDetailBytes)};
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) {
    if (models_.size() >= kMaxModels) return;
    it = models_.emplace(model, std::map<uint64_t, std::vector<StageRecord>>()).first;
  }
  auto& versions = it->second;
  if (versions.size() >= kKeepVersions && !versions.count(version) &&
      version < versions.begin()->first) {
    return;  // older than every version kept
  }
  std::vector<StageRecord>& stages = versions[version];
  while (versions.size() > kKeepVersions) versions.erase(versions.begin());
  for (const StageRecord& s : stages) {
    if (s.stage == record.stage && s.detail == record.detail) return;
  }
  if (stages.size() >= kMaxStages) return;
  stages.push_back(std::move(record));
}

void Timeline::Mark(const std::string& model, uint64_t version, const std::string& stage,
                    const std::string& detail) {
  const int64_t now = WallMicros();
  Record(model, version, stage, now, now, detail);
}

std::vector<VersionRecord> Timeline::Get(const std::string& model, uint64_t version) const {
  common::MutexLock lock(mu_);
  std::vector<VersionRecord> out;
  auto it = models_.find(model);
  if (it == models_.end()) return out;
  for (const auto& [v, stages] : it->second) {
    if (version != 0 && v != version) continue;
    out.push_back({v, stages});
    // By start time: a Publish's span is recorded when it ends, after the completion it caused.
    std::stable_sort(
        out.back().stages.begin(), out.back().stages.end(),
        [](const StageRecord& a, const StageRecord& b) { return a.start_us < b.start_us; });
  }
  return out;
}

}  // namespace refit::rl
