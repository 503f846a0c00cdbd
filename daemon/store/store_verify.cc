// Verified install: what Apply wrote, checked against the version (Store::NotLanded, the
// DATA_LOSS an Apply answers), and checked again later (Store::Verify, refitctl verify). The
// comparisons themselves and the naming of stale tensors are the Verifier's (verify.h); here,
// what the store gathers for them under its lock.

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/plan.h"
#include "daemon/store/quantized_slots.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"
#include "daemon/store/verify.h"

namespace refit {

std::map<std::string, std::vector<std::string>> Store::TensorsOfOps(
    const plan::Plan& plan, const std::vector<size_t>& bad,
    const std::vector<std::shared_ptr<Buffer>>& dests) {
  std::vector<VerifyTarget> targets;
  targets.reserve(dests.size());
  for (const auto& buffer : dests) targets.push_back({buffer->id, &buffer->slices});
  return refit::TensorsOfOps(plan, bad, targets);
}

absl::Status Store::NotLanded(const Version& version, const plan::Plan& plan,
                              const std::vector<size_t>& bad,
                              const std::vector<std::shared_ptr<Buffer>>& dests, bool restored) {
  const auto tensors = TensorsOfOps(plan, bad, dests);
  std::vector<std::string> parts;
  for (const auto& [id, names] : tensors) {
    parts.push_back(absl::StrCat("buffer ", id, ": ", absl::StrJoin(names, ", ")));
  }
  counters_.apply_verify_failures.Add(1);
  std::string outcome;
  if (restored) {
    // The undo journal put every byte back: each buffer holds what it held before the call.
    outcome =
        "; every destination buffer was put back as it was before the call (nothing of this "
        "version is in them): Apply again";
  } else {
    for (const auto& d : dests) d->applied = 0;  // what landed is not one version throughout
    outcome =
        "; these tensors are stale: Apply again, or Apply the previous version to restore them";
  }
  const std::string message = absl::StrCat(
      "Apply of version ", version.number,
      ": the bytes that landed differ from the version's "
      "for ",
      absl::StrJoin(parts, "; "),
      " (something wrote into the destination during the copy, or the memory is faulty)", outcome);
  Logger("store")->error("{}", message);
  return absl::DataLossError(message);
}

absl::Status Store::VerifyReleased(const std::string& model_name, const Version& version) {
  std::vector<PullJob::Fetch> fetches;
  {
    common::MutexLock lock(mu_);
    const Model* model = FindModel(model_name);
    const auto base = model ? model->destination_base : nullptr;
    if (!base || base->version != version.number) {
      return absl::FailedPreconditionError("no digests of the released version");
    }
    for (const auto& [index, digests] : base->pieces) {
      const Piece& piece = base->source->pieces[index];
      PullJob::Fetch fetch;
      fetch.node = piece.node;
      fetch.buffer_id = piece.buffer_id;
      fetch.base_version = version.number;
      fetch.destination_base = true;
      for (const auto& [b, e] : digests.segments) fetch.bytes = std::max(fetch.bytes, e);
      fetches.push_back(std::move(fetch));
    }
  }
  for (const PullJob::Fetch& fetch : fetches) {
    // The piece rebuilt from the destinations (the Apply's plan backwards) and hashed.
    auto rebuilt = BaseFromDestinations(model_name, fetch);
    if (rebuilt.ok()) continue;
    if (rebuilt.status().message().find("differ from version") != std::string::npos) {
      return absl::DataLossError(rebuilt.status().message());
    }
    return rebuilt.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<VerifyResult>> Store::Verify(const std::string& model_name) {
  struct Job {
    size_t result = 0;
    std::shared_ptr<Buffer> buffer;
    std::shared_ptr<const Version> version;
    std::shared_ptr<const CachedPlan> plan;
  };
  std::vector<VerifyResult> results;
  std::vector<Job> jobs;
  {
    common::MutexLock lock(mu_);
    Model* model = FindModel(model_name);
    if (!model) return absl::NotFoundError(absl::StrCat("model ", model_name, " does not exist"));
    for (const std::string& id : model->destinations) {
      VerifyResult result;
      result.buffer_id = id;
      const std::shared_ptr<Buffer>& buffer = buffers_.at(id);
      result.version = buffer->applied;
      auto version = model->complete.find(result.version);
      if (result.version == 0) {
        result.note = "no verified Apply into it yet (or its last one failed)";
      } else if (version == model->complete.end()) {
        result.note = absl::StrCat("version ", result.version,
                                   " is no longer held here (--retain): nothing to compare with");
      } else if (buffer->region->kind() != MemoryKind::kHost) {
        result.note = "GPU memory: not compared here";
      } else {
        auto cached = PlanFor(*model, *version->second, {buffer});
        if (!cached.ok()) {
          result.note = std::string(cached.status().message());
        } else {
          jobs.push_back({results.size(), buffer, version->second, *cached});
        }
      }
      results.push_back(std::move(result));
    }
  }
  Verifier verifier(model_name);
  for (const Job& job : jobs) {
    VerifyResult& result = results[job.result];
    if (absl::Status held = CheckHeld(*job.version, job.plan->Reads()); !held.ok()) {
      // --delta-base=destination released the held copy: the destinations are checked against
      // the digests taken of it before it went (the trainer's bytes, as pulled and verified).
      verifier.Released(held, VerifyReleased(model_name, *job.version), &result);
      continue;
    }
    std::vector<std::shared_ptr<Region>> derived;
    if (!job.plan->jobs.empty()) {
      auto slots = QuantizedSlots(*job.version, *job.plan);
      if (!slots.ok()) {
        result.note = std::string(slots.status().message());
        continue;
      }
      derived = std::move(slots).value();
    }
    std::vector<const uint8_t*> src;
    bool host = true;
    for (const Piece& piece : job.version->pieces) {
      src.push_back(piece.slot ? piece.slot->data() : nullptr);
      host = host && (!piece.slot || piece.slot->kind() == MemoryKind::kHost);
    }
    for (const auto& slot : derived) {
      src.push_back(slot->data());
      host = host && slot->kind() == MemoryKind::kHost;
    }
    if (!host) {
      result.note = "the version is held in GPU slots: not compared here";
      continue;
    }
    common::MutexLock io(job.buffer->io_mu);
    if (job.buffer->region->Broken()) {
      result.note = "its memory went away under refitd";
      continue;
    }
    verifier.Compare(job.plan->plan, src, {job.buffer->id, &job.buffer->slices},
                     job.buffer->region->data(), &result);
  }
  return verifier.Finish(std::move(results));
}

}  // namespace refit
