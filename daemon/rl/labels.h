#pragma once

// Provenance: the trainer's labels of each version (PublishRequest.labels: step, run id, wall
// time, a free-form label), kept per model for the newest kKeepVersions versions, on the node
// where they were published and on every node that heard the version announced
// (PeerEvent.labels), so Watch, Status and the engines' adapters deliver them with the version.
// With --state-dir they outlive a restart (LabelsStore).
//
// Thread-safety: every method may be called from any thread.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/mutex.h"

namespace refit::rl {

using Labels = std::map<std::string, std::string>;

// Keys and values of one version's labels, in bytes, all together.
inline constexpr size_t kMaxLabelBytes = 1024;

// INVALID_ARGUMENT when `labels` hold more than kMaxLabelBytes of keys and values, or an
// empty key; OK otherwise.
absl::Status CheckLabels(const Labels& labels);

// Where VersionLabels keeps each model's labels across restarts (daemon/state's LabelsFile
// under --state-dir); called with the model's versions after every change, in order.
class LabelsStore {
 public:
  virtual ~LabelsStore() = default;
  // `versions` empty: the model carries no labels any more.
  virtual void Save(const std::string& model, const std::map<uint64_t, Labels>& versions) = 0;
};

class VersionLabels {
 public:
  // Every later change of a model's labels is saved to `store` (not owned; nullptr: memory
  // only). Set once, before the labels are shared.
  void set_store(LabelsStore* store);
  // What `store` kept of `model` before a restart: set without saving them again.
  void Restore(const std::string& model, std::map<uint64_t, Labels> versions);

  static constexpr size_t kKeepVersions = 16;  // per model, the newest
  static constexpr size_t kMaxModels = 4096;   // a model past it is not kept

  // `version` of `model` carries `labels` (replacing what it carried; empty: nothing kept).
  void Set(const std::string& model, uint64_t version, Labels labels);
  // Sets them only when the version carries none yet: true when it set them.
  bool SetIfAbsent(const std::string& model, uint64_t version, const Labels& labels);
  // Forgets the labels of `version` (a Publish that failed after setting them).
  void Erase(const std::string& model, uint64_t version);
  // Forgets every version of `model` (refitctl drop: its numbers start over).
  void Forget(const std::string& model);
  // The labels of `version` (empty when unknown).
  Labels Get(const std::string& model, uint64_t version) const;
  // The models Restore() brought back that still carry labels, sorted (Status lists them
  // even before any buffer of them registers again).
  std::vector<std::string> RestoredModels() const;
  // The versions of `model` with labels, oldest first.
  std::vector<std::pair<uint64_t, Labels>> Recent(const std::string& model) const;

 private:
  void TrimLocked(std::map<uint64_t, Labels>& versions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void SaveLocked(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable common::Mutex mu_;
  std::map<std::string, std::map<uint64_t, Labels>> models_ ABSL_GUARDED_BY(mu_);
  LabelsStore* store_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::set<std::string> restored_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::rl
