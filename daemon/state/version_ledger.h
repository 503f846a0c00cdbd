#pragma once

// What refitd remembers across restarts (--state-dir): each model's newest published version,
// so that a trainer that restarts (or whose node's refitd does) cannot publish a number that
// model already used; engines' nodes would hold the old version under that number and skip
// the new one. Without a directory the ledger lives in memory only, for this process.
//
// The file, DIR/state.json, is JSON ({"format": "refit-state", "format_version": 1,
// "models": {"NAME": {"newest_published": N, "run": "R", "past_runs": ["Q"], "hold": H}, ...}};
// run and past_runs only when a trainer named runs; hold only while the model is rolled back to
// version H on this node: Rollback's hold outlives a restart, until Resume; newest_published 0
// when this node only holds it back), rewritten whole at every change through a
// temporary file, fsync and rename, so that a crash leaves the old file or the new one; Open
// refuses a file it can't read back.
//
// Thread-safety: every method may be called from any thread.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

namespace refit::state {

class VersionLedger {
 public:
  // Reads DIR/state.json (creating DIR when missing); `dir` empty: memory only.
  // INVALID_ARGUMENT naming the file when it is not a valid state file; FAILED_PRECONDITION
  // when DIR can't be created or read.
  static absl::StatusOr<std::unique_ptr<VersionLedger>> Open(const std::string& dir);

  // OK when `model` may publish `version`; FAILED_PRECONDITION naming the newest otherwise: a
  // version below it, or equal to it when that number was published by an earlier process (a
  // number this process published is published again by the model's other source buffers).
  // `run` (PublishRequest.run; empty: the model's current run): another run than the current
  // one is a new run (a resume from a checkpoint), whose numbers may restart: OK, unless it is
  // a run the model left before (FAILED_PRECONDITION).
  absl::Status Check(const std::string& model, uint64_t version, const std::string& run = "") const;

  // `model` published `version` (keeps the max) and persists it. An error means the file could
  // not be written; the number is remembered in memory all the same.
  // With another non-empty `run` than the current one: that run starts (the current one is
  // remembered as left, at most kMaxPastRuns) and `version` is its newest.
  absl::Status Record(const std::string& model, uint64_t version, const std::string& run = "");
  // The model's current run ("": none named) and the runs it left, oldest first.
  std::string Run(const std::string& model) const;
  std::vector<std::string> PastRuns(const std::string& model) const;
  static constexpr size_t kMaxPastRuns = 16;

  // Forgets `model` (refitctl drop), persisting that; returns the version it remembered, 0 if
  // none.
  absl::StatusOr<uint64_t> Forget(const std::string& model);

  uint64_t Newest(const std::string& model) const;

  // The model is held back to `version` on this node (Rollback; 0: Resume ended it), persisted.
  absl::Status RecordHold(const std::string& model, uint64_t version);
  // Every model held back here, with its version (what the store starts with after a restart).
  std::map<std::string, uint64_t> Holds() const;
  const std::string& path() const { return path_; }  // empty: memory only

 private:
  explicit VersionLedger(std::string path) : path_(std::move(path)) {}
  absl::Status Save() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Entry {
    uint64_t newest = 0;
    bool this_process = false;           // `newest` was published since this process started
    std::string run;                     // the trainer's current run ("": none named)
    std::vector<std::string> past_runs;  // runs left, oldest first
    uint64_t hold = 0;                   // rolled back to this version here (0: not)
  };
  const std::string path_;
  mutable common::Mutex mu_;
  std::map<std::string, Entry> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::state
