#include "daemon/rl/labels.h"

#include "absl/strings/str_cat.h"

namespace refit::rl {

absl::Status CheckLabels(const Labels& labels) {
  size_t bytes = 0;
  for (const auto& [key, value] : labels) {
    if (key.empty()) return absl::InvalidArgumentError("a label has an empty key");
    bytes += key.size() + value.size();
  }
  if (bytes > kMaxLabelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("labels of ", bytes,
                                                   " bytes (keys and values) are more than the ",
                                                   kMaxLabelBytes, " a version may carry"));
  }
  return absl::OkStatus();
}

void VersionLabels::TrimLocked(std::map<uint64_t, Labels>& versions) {
  while (versions.size() > kKeepVersions) versions.erase(versions.begin());
}

void VersionLabels::Set(const std::string& model, uint64_t version, Labels labels) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (labels.empty()) {
    if (it != models_.end()) it->second.erase(version);
    return;
  }
  if (it == models_.end()) {
    if (models_.size() >= kMaxModels) return;
    it = models_.emplace(model, std::map<uint64_t, Labels>()).first;
  }
  it->second[version] = std::move(labels);
  TrimLocked(it->second);
}

bool VersionLabels::SetIfAbsent(const std::string& model, uint64_t version, const Labels& labels) {
  if (labels.empty()) return false;
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) {
    if (models_.size() >= kMaxModels) return false;
    it = models_.emplace(model, std::map<uint64_t, Labels>()).first;
  }
  if (!it->second.emplace(version, labels).second) return false;
  TrimLocked(it->second);
  return true;
}

void VersionLabels::Erase(const std::string& model, uint64_t version) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return;
  it->second.erase(version);
  if (it->second.empty()) models_.erase(it);
}

Labels VersionLabels::Get(const std::string& model, uint64_t version) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return {};
  auto v = it->second.find(version);
  return v == it->second.end() ? Labels() : v->second;
}

std::vector<std::pair<uint64_t, Labels>> VersionLabels::Recent(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return {};
  return {it->second.begin(), it->second.end()};
}

}  // namespace refit::rl
