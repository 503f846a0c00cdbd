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

void VersionLabels::set_store(LabelsStore* store) {
  common::MutexLock lock(mu_);
  store_ = store;
}

void VersionLabels::Restore(const std::string& model, std::map<uint64_t, Labels> versions) {
  common::MutexLock lock(mu_);
  for (auto it = versions.begin(); it != versions.end();) {
    if (it->second.empty() || !CheckLabels(it->second).ok()) {
      it = versions.erase(it);
    } else {
      ++it;
    }
  }
  if (versions.empty() || (models_.size() >= kMaxModels && !models_.count(model))) return;
  restored_.insert(model);
  auto& kept = models_[model];
  for (auto& [version, labels] : versions) kept[version] = std::move(labels);
  TrimLocked(kept);
}

void VersionLabels::SaveLocked(const std::string& model) {
  if (store_ == nullptr) return;
  auto it = models_.find(model);
  static const std::map<uint64_t, Labels> kNone;
  store_->Save(model, it == models_.end() ? kNone : it->second);
}

void VersionLabels::TrimLocked(std::map<uint64_t, Labels>& versions) {
  while (versions.size() > kKeepVersions) versions.erase(versions.begin());
}

void VersionLabels::Set(const std::string& model, uint64_t version, Labels labels) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (labels.empty()) {
    if (it != models_.end() && it->second.erase(version) > 0) SaveLocked(model);
    return;
  }
  if (it == models_.end()) {
    if (models_.size() >= kMaxModels) return;
    it = models_.emplace(model, std::map<uint64_t, Labels>()).first;
  }
  auto [slot, added] = it->second.try_emplace(version);
  if (!added && slot->second == labels) return;  // heard again: nothing to save
  slot->second = std::move(labels);
  TrimLocked(it->second);
  SaveLocked(model);
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
  SaveLocked(model);
  return true;
}

void VersionLabels::Erase(const std::string& model, uint64_t version) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return;
  if (it->second.erase(version) == 0) return;
  if (it->second.empty()) models_.erase(it);
  SaveLocked(model);
}

void VersionLabels::Forget(const std::string& model) {
  common::MutexLock lock(mu_);
  restored_.erase(model);
  if (models_.erase(model) > 0) SaveLocked(model);
}

Labels VersionLabels::Get(const std::string& model, uint64_t version) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return {};
  auto v = it->second.find(version);
  return v == it->second.end() ? Labels() : v->second;
}

std::vector<std::string> VersionLabels::RestoredModels() const {
  common::MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const std::string& model : restored_) {
    if (models_.count(model) > 0) out.push_back(model);
  }
  return out;
}

std::vector<std::pair<uint64_t, Labels>> VersionLabels::Recent(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return {};
  return {it->second.begin(), it->second.end()};
}

}  // namespace refit::rl
