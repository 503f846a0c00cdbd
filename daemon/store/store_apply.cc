// Store::Apply: a version's bytes into DESTINATION buffers, all or nothing. The plan runs only
// after every check that can fail without writing; the bytes it may overwrite are saved in the
// undo journal first (apply_journal.h), and an Apply that fails after that (bytes that did not
// land, memory gone) puts them back. docs/architecture.md, "Atomic Apply".

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/test_hooks.h"
#include "daemon/plan/plan.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {

std::vector<ByteRanges> DestinationExtents(const plan::Plan& plan, size_t locations) {
  std::vector<ByteRanges> out(locations);
  for (const plan::CopyOp& op : plan.ops) {
    if (op.dst_location >= locations || op.count == 0) continue;
    const uint64_t elem = DTypeSize(op.dst_dtype);
    const uint64_t run = ((op.count - 1) * static_cast<uint64_t>(op.dst_stride) + 1) * elem;
    for (uint64_t r = 0; r < op.rows; ++r) {
      const uint64_t begin = op.dst_offset + r * static_cast<uint64_t>(op.dst_row_stride) * elem;
      out[op.dst_location].emplace_back(begin, begin + run);
    }
  }
  for (ByteRanges& ranges : out) MergeRanges(&ranges);
  return out;
}

std::vector<UndoTarget> Store::UndoTargets(const CachedPlan& cached,
                                           const std::vector<std::shared_ptr<Buffer>>& dests,
                                           uint64_t version) {
  std::vector<UndoTarget> targets;
  for (size_t j = 0; j < dests.size(); ++j) {
    UndoTarget t;
    t.identity = dests[j]->memory;
    t.data = dests[j]->region->data();
    t.size = dests[j]->region->size();
    t.prev_version = dests[j]->applied;
    t.version = version;
    if (j < cached.dst_extents.size()) t.ranges = cached.dst_extents[j];
    targets.push_back(std::move(t));
  }
  return targets;
}

absl::StatusOr<ApplyResult> Store::Apply(const std::string& model_name, uint64_t version,
                                         const std::vector<std::string>& buffer_ids) {
  const auto started = Clock::now();
  std::shared_ptr<const Version> source;
  std::shared_ptr<const CachedPlan> cached;
  std::shared_ptr<const Version> applied_base;
  std::vector<std::shared_ptr<Buffer>> dests;
  std::shared_ptr<const PreparedSparse> prepared;
  {
    common::UniqueLock lock(mu_);
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
    Model* model = FindModel(model_name);
    if (!model) return absl::NotFoundError(absl::StrCat("model ", model_name, " does not exist"));
    ASSIGN_OR_RETURN(dests, LookUpBuffers(model_name, Role::kDestination, buffer_ids));
    for (const auto& d : dests) {
      if (!d->refused.empty()) return absl::FailedPreconditionError(d->refused);
    }
    const uint64_t wanted = version == 0 ? TargetOf(*model) : version;
    if (model->hold != 0 && wanted > model->hold) {
      return absl::FailedPreconditionError(
          absl::StrCat("model ", model_name, ": rolled back to version ", model->hold, "; version ",
                       wanted, " is held back until Resume (refitctl resume ", model_name, ")"));
    }
    if (wanted == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("model ", model_name, " has no complete version on this node yet"));
    }
    auto it = model->complete.find(wanted);
    if (it == model->complete.end()) {
      if (wanted == model->hold) {
        return absl::FailedPreconditionError(absl::StrCat(
            "model ", model_name, ": rolled back to version ", wanted,
            ", which this node does not hold (a hold kept across a restart, or asked by "
            "another node: engines that applied it keep it); newer versions are held back until "
            "Resume (refitctl resume ",
            model_name, "; latest complete: ", model->latest, ")"));
      }
      // Dropped by --retain: it completed here once (or is older than the history kept).
      // Otherwise it never completed here (a version a pull skipped for a newer one).
      const bool dropped =
          wanted < model->latest &&
          (model->history.empty() || wanted < model->history.front() ||
           std::find(model->history.begin(), model->history.end(), wanted) != model->history.end());
      if (dropped) {
        return absl::NotFoundError(absl::StrCat("model ", model_name, ": version ", wanted,
                                                " is no longer held (--retain=", options_.retain,
                                                "; oldest held is ", model->complete.begin()->first,
                                                ")"));
      }
      if (wanted == model->failed) {
        return absl::FailedPreconditionError(absl::StrCat(
            "model ", model_name, ": version ", wanted, " was abandoned on this node (",
            model->failed_status.ToString(), "); latest complete: ", model->latest));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("model ", model_name, ": version ", wanted,
                       " is not complete on this node (latest complete: ", model->latest, ")"));
    }
    source = it->second;
    ASSIGN_OR_RETURN(cached, PlanFor(*model, *source, dests));
    // Sparse Apply: the version the destinations hold, if it is still held here.
    auto held = model->complete.find(dests.empty() ? 0 : dests[0]->applied.load());
    if (held != model->complete.end() && held->second != source) applied_base = held->second;
    // Its sparse Apply prepared as it completed (store_sparse_prepared.cc), once ready.
    if (applied_base) prepared = AwaitPrepared(*model, lock, source, applied_base, dests);
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
  }
  RETURN_IF_ERROR(CheckHeld(*source, cached->Reads()));
  std::vector<std::shared_ptr<Region>> derived;
  if (!cached->jobs.empty()) {
    // Quantized when the version completed; only destinations registered since then wait here.
    ASSIGN_OR_RETURN(derived, QuantizedSlots(*source, *cached));
  }

  // Buffers are locked in id order (LookUpBuffers keeps request order; sort for safety).
  std::vector<Buffer*> order;
  for (const auto& d : dests) order.push_back(d.get());
  std::sort(order.begin(), order.end(),
            [](const Buffer* a, const Buffer* b) { return a->id < b->id; });
  std::vector<std::unique_lock<common::Mutex>> locks;
  for (Buffer* b : order) locks.emplace_back(b->io_mu);
  for (const auto& d : dests) {
    if (d->region->Broken()) return MemoryWentAway(*d, "");
  }

  bool host_sources = true;
  for (const Piece& piece : source->pieces) {
    host_sources = host_sources && (!piece.slot || piece.slot->kind() == MemoryKind::kHost);
  }
  bool all_host = host_sources;
  for (const auto& d : dests) all_host = all_host && d->region->kind() == MemoryKind::kHost;
  std::unique_ptr<ApplyJournal::Entry> undo;
  if (host_sources) {
    // The destinations hold the version this one was diffed against: write what changed (into
    // host destinations here, into GPU ones as byte runs: store_sparse_runs.cc).
    if (auto sparse = ApplySparse(*source, applied_base, *cached, dests, derived, prepared.get())) {
      if (!sparse->ok()) return sparse->status();
      return Applied(model_name, source, dests, **sparse, started);
    }
  }
  if (all_host) {
    // All or nothing: the bytes this Apply overwrites are saved in the undo journal
    // (apply_journal.h), each piece just before it is written (folded into the verified copy;
    // the plain copy below saves them all first); every error from here on puts them back.
    static const bool unverified = TestSwitch("REFIT_TEST_APPLY_UNVERIFIED") != nullptr;
    if (unverified) {
      ASSIGN_OR_RETURN(undo, journal_->Begin(UndoTargets(*cached, dests, source->number)));
    } else {
      ASSIGN_OR_RETURN(
          undo, journal_->BeginFolded(UndoTargets(*cached, dests, source->number), cached->plan));
    }
    std::vector<const uint8_t*> src;
    for (const Piece& piece : source->pieces) {
      src.push_back(piece.slot ? piece.slot->data() : nullptr);
    }
    for (const auto& slot : derived) src.push_back(slot->data());
    std::vector<uint8_t*> dst;
    for (const auto& d : dests) dst.push_back(d->region->data());
    // Verified install: each block checked against the version as it lands. Test build only,
    // REFIT_TEST_APPLY_UNVERIFIED: the plain copy, unchecked, for a benchmark that puts the
    // verified Apply beside it (an engine's refitd of each kind in one run).
    std::vector<size_t> bad;
    if (unverified) {
      plan::ExecuteOnHost(cached->plan, src, dst);
    } else {
      bad = plan::ExecuteSaveAndVerifyOnHost(cached->plan, src, dst, undo->saved(), undo->marks());
    }
    if (!bad.empty()) {
      undo->Restore();
      return NotLanded(*source, cached->plan, bad, dests, /*restored=*/true);
    }
  } else {
    // GPU slots or GPU destinations: copies and kernels on the GPU (cuda/).
    std::vector<const Region*> src;
    for (const Piece& piece : source->pieces) src.push_back(piece.slot.get());
    for (const auto& slot : derived) src.push_back(slot.get());
    std::vector<const Region*> dst;
    for (const auto& d : dests) dst.push_back(d->region.get());
    RETURN_IF_ERROR(cuda::ExecutePlan(cached->plan, src, dst));
  }

  for (const auto& d : dests) {
    if (!d->region->Broken()) continue;
    if (!undo) {
      return MemoryWentAway(
          *d, absl::StrCat(" (the other destination buffers hold version ", source->number, ")"));
    }
    std::vector<bool> gone;
    for (const auto& other : dests) gone.push_back(other->region->Broken());
    undo->Restore(gone);
    return MemoryWentAway(*d, " (the other destination buffers were put back as they were)");
  }
  const uint64_t undo_bytes = undo ? undo->undo_bytes() : 0;
  if (undo) undo->Commit();
  return Applied(model_name, source, dests,
                 ApplyResult{source->number, cached->plan.dst_bytes, undo_bytes, false}, started);
}

ApplyResult Store::Applied(const std::string& model_name,
                           const std::shared_ptr<const Version>& source,
                           const std::vector<std::shared_ptr<Buffer>>& dests, ApplyResult result,
                           Clock::time_point started) {
  for (const auto& d : dests) d->applied = source->number;
  counters_.apply_bytes.Add(static_cast<double>(result.bytes_written));
  counters_.apply_undo_bytes.Add(static_cast<double>(result.undo_bytes));
  if (result.sparse) counters_.apply_sparse.Add(1);
  if (result.prepared) counters_.apply_sparse_prepared.Add(1);
  counters_.applies.Add(1);
  counters_.apply_seconds.Observe(std::chrono::duration<double>(Clock::now() - started).count());
  ReleaseApplied(model_name, source);  // --delta-base=destination: the destinations hold it now
  {
    common::MutexLock lock(mu_);
    if (Model* model = FindModel(model_name)) RememberApplyGroup(*model, dests);
  }
  return result;
}

absl::Status Store::CheckHeld(const Version& version, const plan::Plan& plan) const {
  for (const plan::CopyOp& op : plan.ops) {
    const Piece& piece = version.pieces[op.src_location];
    if (piece.slot && !piece.valid) continue;
    if (piece.slot && RangesCover(*piece.valid, op)) continue;
    if (piece.released) {
      return absl::FailedPreconditionError(absl::StrCat(
          "version ", version.number,
          " is held here only in the DESTINATION buffers its Apply "
          "filled (--delta-base=destination released the held copy): Apply the next version"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", version.number, " was pulled for other destination buffers; bytes of ",
        piece.buffer_id, " on node ", piece.node,
        " these buffers need are not here (the next version will bring them)"));
  }
  return absl::OkStatus();
}

}  // namespace refit
