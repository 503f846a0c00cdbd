#pragma once

// The trainer's labels of each model's newest versions (daemon/rl VersionLabels), kept across
// restarts under --state-dir: DIR/labels/<model>.json, one file per model, so that Status,
// Watch and the engines' adapters still tell which step made a version after a node restarts
// (refit.lora reads an adapter's rank and targets from them).
//
// A file: {"format": "refit-labels", "format_version": 1, "model": "NAME",
// "versions": {"N": {"key": "value", ...}, ...}}, rewritten whole at every change (at most
// VersionLabels::kKeepVersions versions of at most 1 KiB each) through a temporary file, fsync
// and rename; a model without labels any more has no file. The file's name is the model name
// with characters outside [A-Za-z0-9._-] replaced, cut to 64 bytes, and a hash of the whole
// name; the name inside the file is the one that counts.
//
// Labels are provenance, not safety: a file that can't be read back is left out with a
// warning naming it (the ledger, state.json, is what refuses to start), and a failed write is
// logged and retried at the model's next change.
//
// Thread-safety: Save may be called from any thread (VersionLabels serializes it per model
// under its lock).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/rl/labels.h"

namespace refit::state {

class LabelsFile : public rl::LabelsStore {
 public:
  // DIR/labels (created when missing). FAILED_PRECONDITION when it can't be created.
  static absl::StatusOr<std::unique_ptr<LabelsFile>> Open(const std::string& dir);

  struct Loaded {
    std::map<std::string, std::map<uint64_t, rl::Labels>> models;
    std::vector<std::string> skipped;  // files left out, each with why
  };
  // Every model's labels the directory holds.
  Loaded Load() const;

  void Save(const std::string& model, const std::map<uint64_t, rl::Labels>& versions) override;

  // The file of `model`.
  std::string PathOf(const std::string& model) const;
  const std::string& dir() const { return dir_; }

 private:
  explicit LabelsFile(std::string dir) : dir_(std::move(dir)) {}
  const std::string dir_;
};

}  // namespace refit::state
