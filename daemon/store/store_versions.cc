// Store: which version an engine is asked to hold. Runs (a trainer that starts a new run or
// resumes from a checkpoint restarts its version numbers: the previous run's versions are let
// go) and rollback (a retained version held as the target until Resume). Watch's events come
// from here. docs/architecture.md, "Runs" and "Rollback".

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/names.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

constexpr size_t kMaxEvents = 4096;  // Watch events remembered per model
constexpr size_t kMaxPastRuns = 16;  // runs remembered as left, per model
constexpr auto kWaitSlice = std::chrono::milliseconds(50);

}  // namespace

uint64_t Store::TargetOf(const Model& model) { return model.hold != 0 ? model.hold : model.latest; }

void Store::AddEvent(Model& model, uint64_t version, bool rollback) {
  model.events.push_back({next_event_++, VersionTarget{version, rollback, model.run}});
  while (model.events.size() > kMaxEvents) model.events.pop_front();
  changed_.NotifyAll();
}

void Store::StartRun(Model& model, const std::string& run, const std::string& why) {
  Logger("store")->warn(
      "model={} run {} starts ({}); run {} left: its {} version(s) here (newest {}) are let go, "
      "and the new run's versions are taken even below them",
      model.name, run.empty() ? "(unnamed)" : run, why, model.run.empty() ? "(unnamed)" : model.run,
      model.complete.size(), model.latest);
  if (!model.run.empty()) {
    model.past_runs.erase(std::remove(model.past_runs.begin(), model.past_runs.end(), run),
                          model.past_runs.end());
    model.past_runs.push_back(model.run);
    while (model.past_runs.size() > kMaxPastRuns) model.past_runs.pop_front();
  }
  model.run = run;
  counters_.versions_dropped.Add(static_cast<double>(model.complete.size()));
  // Readers (an Apply in flight, a peer's pin) keep their own references to what goes here.
  model.complete.clear();
  model.pending.clear();
  model.early_quant.clear();
  model.snapshots.clear();
  model.history.clear();
  model.latest = 0;
  model.local_ready = 0;
  model.failed = 0;
  model.failed_status = absl::OkStatus();
  model.skipped = 0;
  model.skipped_reason.clear();
  model.latest_runs.clear();
  model.pulling = 0;  // FinishPull drops a pull of the old run (PullJob::run)
  model.pulling_changed.clear();
  model.pulling_pieces.clear();
  budget_.EndStaging(model.name);
  model.finishing = 0;  // the quantizer drops a version of the old run (Version::run)
  model.destination_base.reset();
  // The old run's prepared sparse Applies: their numbers say nothing about the new run's (and
  // the queued ones are skipped: not the entry of their set any more).
  model.prepared.clear();
  model.hold = 0;  // a rollback names a version of the old run
  for (const std::string& id : model.sources) buffers_.at(id)->last_published = 0;
  // The engine's bytes are of the old run: their numbers say nothing about the new run's.
  for (const std::string& id : model.destinations) buffers_.at(id)->applied = 0;
  for (StoreEvents* listener : listeners_) listener->OnRunStarted(model.name, run);
  changed_.NotifyAll();
}

std::string Store::RunOf(const std::string& model_name) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  return model ? model->run : "";
}

void Store::SeedRun(const std::string& model_name, const std::string& run,
                    const std::vector<std::string>& past_runs) {
  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model || !model->run.empty() || model->latest != 0) return;
  model->run = run;
  model->past_runs.assign(past_runs.begin(), past_runs.end());
}

void Store::SeedHolds(const std::map<std::string, uint64_t>& holds) {
  common::MutexLock lock(mu_);
  for (const auto& [name, version] : holds) {
    if (version == 0) continue;
    seeded_holds_[name] = version;
    if (Model* model = FindModel(name)) SeedHold(*model);
  }
}

void Store::SeedHold(Model& model) {
  auto it = seeded_holds_.find(model.name);
  if (it == seeded_holds_.end() || model.hold == it->second) return;
  model.hold = it->second;
  Logger("store")->warn(
      "model={} is rolled back to version {} (kept across a restart in --state-dir): newer "
      "versions are held back until Resume (refitctl resume {})",
      model.name, model.hold, model.name);
  AddEvent(model, model.hold, true);
}

uint64_t Store::HoldOf(const std::string& model_name) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  return model ? model->hold : 0;
}

absl::Status Store::CheckRollback(const std::string& model_name, uint64_t version) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  if (!model) {
    std::vector<std::string> known;
    for (const auto& [n, m] : models_) known.push_back(n);
    return absl::NotFoundError(absl::StrCat("model ", model_name, " is not known to this node",
                                            KnownModelsHint(model_name, known)));
  }
  return RetainedForRollback(*model, version);
}

absl::Status Store::RetainedForRollback(const Model& model, uint64_t version) const {
  if (version == 0) return absl::InvalidArgumentError("rollback needs a version >= 1");
  if (model.complete.count(version)) return absl::OkStatus();
  if (model.complete.empty()) {
    return absl::NotFoundError(absl::StrCat("model ", model.name, ": version ", version,
                                            " is not retained here: no version is held"));
  }
  std::vector<std::string> held;
  for (const auto& [v, ver] : model.complete) held.push_back(absl::StrCat(v));
  return absl::NotFoundError(absl::StrCat("model ", model.name, ": version ", version,
                                          " is not retained here (--retain=", options_.retain,
                                          "; oldest retained is ", model.complete.begin()->first,
                                          ", held: ", absl::StrJoin(held, ", "), ")"));
}

std::vector<std::string> Store::SourceNodes(const std::string& model_name) const {
  return remotes_.SourceNodes(model_name);  // the view's lock alone
}

bool Store::WaitForHold(const std::string& model_name, uint64_t version,
                        Clock::time_point deadline) {
  common::UniqueLock lock(mu_);
  while (true) {
    const Model* model = FindModel(model_name);
    if ((model ? model->hold : 0) == version) return true;
    const auto now = Clock::now();
    if (shutdown_ || now >= deadline) return false;
    changed_.WaitUntil(lock, std::min(deadline, now + kWaitSlice));
  }
}

absl::StatusOr<uint64_t> Store::Rollback(const std::string& model_name, uint64_t version) {
  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model) {
    std::vector<std::string> known;
    for (const auto& [n, m] : models_) known.push_back(n);
    return absl::NotFoundError(absl::StrCat("model ", model_name, " is not known to this node",
                                            KnownModelsHint(model_name, known)));
  }
  if (absl::Status retained = RetainedForRollback(*model, version); !retained.ok()) {
    return retained;
  }
  seeded_holds_.erase(model_name);
  if (model->hold == version) return version;  // already there (forwarded twice)
  model->hold = version;
  Logger("store")->warn(
      "model={} rolled back to version {} (newest complete {}); newer versions "
      "are held back until Resume",
      model_name, version, model->latest);
  AddEvent(*model, version, true);
  for (StoreEvents* listener : listeners_) listener->OnHoldChanged(model_name, version);
  return version;
}

absl::Status Store::Resume(const std::string& model_name) {
  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model || model->hold == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_name, " is not rolled back on this node: nothing to resume"));
  }
  const uint64_t was = model->hold;
  model->hold = 0;
  seeded_holds_.erase(model_name);
  Logger("store")->warn("model={} resumed from rollback to version {}: version {} is the target",
                        model_name, was, model->latest);
  // The engine holds the rollback version: tell it the newest, unless that is the same one.
  if (model->latest != 0 && model->latest != was) AddEvent(*model, model->latest, false);
  // Trim what the hold kept beyond --retain.
  while (model->complete.size() > std::max<uint32_t>(1, options_.retain)) {
    model->complete.erase(model->complete.begin());
    counters_.versions_dropped.Add(1);
  }
  for (StoreEvents* listener : listeners_) listener->OnHoldChanged(model_name, 0);
  changed_.NotifyAll();
  return absl::OkStatus();
}

void Store::FollowHold(const std::string& node, const std::string& model_name, uint64_t version) {
  {
    common::MutexLock lock(mu_);
    Model* model = FindModel(model_name);
    if (!model) return;
    if (!remotes_.SetHold(model_name, node, version)) return;
    if (model->destinations.empty() && model->sources.empty()) return;
  }
  if (version == 0) {
    absl::Status resumed = Resume(model_name);
    if (!resumed.ok() && resumed.code() != absl::StatusCode::kFailedPrecondition) {
      Logger("store")->warn("model={} resume asked by node {}: {}", model_name, node,
                            resumed.ToString());
    }
    return;
  }
  auto rolled = Rollback(model_name, version);
  if (!rolled.ok()) {
    // Held back all the same (newer versions are not delivered); Apply of it says why.
    Logger("store")->error("model={} rollback to version {} asked by node {}: {}", model_name,
                           version, node, rolled.status().ToString());
    common::MutexLock lock(mu_);
    if (Model* model = FindModel(model_name)) {
      model->hold = version;
      AddEvent(*model, version, true);
    }
  }
}

uint64_t Store::WatchCursor(const std::string& model_name, uint64_t after_version) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  const uint64_t now = next_event_ - 1;
  if (!model) return now;
  if (after_version == 0) {
    // Live events; a watch that starts during a rollback hears of it first.
    if (model->hold != 0) {
      for (auto it = model->events.rbegin(); it != model->events.rend(); ++it) {
        if (it->target.rollback) return it->seq - 1;
      }
    }
    return now;
  }
  // Replay the retained versions of the current run newer than after_version.
  for (const Model::Event& e : model->events) {
    if (e.target.run == model->run && e.target.version > after_version && !e.target.rollback &&
        model->complete.count(e.target.version)) {
      return e.seq - 1;
    }
  }
  return now;
}

absl::StatusOr<std::vector<VersionTarget>> Store::WaitForEvents(const std::string& model_name,
                                                                uint64_t* cursor,
                                                                Clock::time_point deadline,
                                                                const CancelledFn& cancelled) {
  common::UniqueLock lock(mu_);
  while (true) {
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
    if (const Model* model = FindModel(model_name)) {
      std::vector<VersionTarget> out;
      for (const Model::Event& e : model->events) {
        if (e.seq > *cursor) {
          out.push_back(e.target);
          *cursor = e.seq;
        }
      }
      if (!out.empty()) return out;
    }
    if (cancelled && cancelled()) return absl::CancelledError("the caller went away");
    const auto now = Clock::now();
    if (now >= deadline) return absl::DeadlineExceededError("deadline passed while waiting");
    changed_.WaitUntil(lock, std::min(deadline, now + kWaitSlice));
  }
}

}  // namespace refit
