// Store: versions whose SOURCE buffers span several nodes. A node learns other nodes' SOURCE
// layouts and announced versions from daemon/peer; version N of a model completes here once
// every local source published N, every other node with sources announced N, and (when this
// node has DESTINATION buffers) the data plane pulled every byte those destinations need.

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {

void AppendSourceRuns(const plan::CopyOp& op, ByteRanges* out) {
  const uint64_t es = DTypeSize(op.src_dtype);
  const uint64_t run = (static_cast<uint64_t>(op.count - 1) * op.src_stride + 1) * es;
  for (uint64_t r = 0; r < op.rows; ++r) {
    const uint64_t begin = op.src_offset + r * static_cast<uint64_t>(op.src_row_stride) * es;
    out->emplace_back(begin, begin + run);
  }
}

void MergeRanges(ByteRanges* ranges) {
  std::sort(ranges->begin(), ranges->end());
  ByteRanges merged;
  for (const auto& r : *ranges) {
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges->swap(merged);
}

bool RangesCover(const ByteRanges& valid, const plan::CopyOp& op) {
  ByteRanges runs;
  AppendSourceRuns(op, &runs);
  for (const auto& [begin, end] : runs) {
    auto it = std::upper_bound(valid.begin(), valid.end(), std::make_pair(begin, UINT64_MAX));
    if (it == valid.begin()) return false;
    --it;
    if (it->first > begin || it->second < end) return false;
  }
  return true;
}

bool Store::HasRemoteSources(const Model& model) const { return remotes_.HasSources(model.name); }

void Store::NoteLocalReady(Model& model) {
  if (model.sources.empty()) return;
  uint64_t newest = 0;
  for (const auto& [version, pieces] : model.pending) {
    if (std::all_of(model.sources.begin(), model.sources.end(),
                    [&p = pieces](const std::string& id) { return p.count(id) > 0; })) {
      newest = version;
    }
  }
  if (newest <= model.local_ready) return;
  model.local_ready = newest;
  if (std::none_of(listeners_.begin(), listeners_.end(),
                   [](const StoreEvents* l) { return l->WantsLocalSnapshots(); })) {
    // Nobody reads local snapshots (no other nodes to serve), but listeners still hear of it.
    for (StoreEvents* listener : listeners_) listener->OnLocalVersionReady(model.name, newest);
    return;
  }
  auto snapshot = std::make_shared<LocalSnapshot>();
  snapshot->model = model.name;
  snapshot->version = newest;
  snapshot->run = model.run;
  for (const auto& [id, piece] : model.pending[newest]) {
    if (model.sources.count(id)) {
      snapshot->pieces.push_back(
          {id, piece.host ? piece.host : piece.slot, piece.xxh3, piece.range_xxh3});
    }
  }
  model.snapshots[newest] = std::move(snapshot);
  while (model.snapshots.size() > std::max<uint32_t>(1, options_.retain)) {
    model.snapshots.erase(model.snapshots.begin());  // pinned readers keep their own reference
  }
  for (StoreEvents* listener : listeners_) listener->OnLocalVersionReady(model.name, newest);
}

void Store::TryCompleteWithRemotes(Model& model) {
  if (model.pulling != 0) return;  // one pull per model at a time; the newest goes next
  const uint64_t candidate = remotes_.Agreed(model.name, model.run);
  if (candidate <= model.latest || candidate <= model.failed) return;
  std::vector<Piece> pieces;
  if (!model.sources.empty()) {
    auto it = model.pending.find(candidate);
    if (it == model.pending.end()) return;
    for (const std::string& id : model.sources) {
      if (it->second.count(id) == 0) return;
    }
    for (const auto& [id, piece] : it->second) pieces.push_back(piece);
  }
  const RemoteView::Nodes remotes = remotes_.Of(model.name);
  for (const auto& [node, remote] : remotes) {
    for (const SourceLayout& layout : remote.sources) {
      Piece piece;
      piece.node = node;
      piece.buffer_id = layout.buffer_id;
      piece.slices = layout.slices;
      for (const RemotePieceRef& ref : remote.pieces) {
        if (ref.buffer_id == layout.buffer_id) piece.remote_key = ref.remote_key;
      }
      if (auto it = remote.imported.find(layout.buffer_id); it != remote.imported.end()) {
        piece.slot = it->second;  // every byte is here already
      } else if (piece.remote_key.empty()) {
        Logger("store")->warn("model={} version={} node={} announced no piece for buffer {}",
                              model.name, candidate, node, layout.buffer_id);
        return;
      }
      pieces.push_back(std::move(piece));
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return std::tie(a.node, a.buffer_id) < std::tie(b.node, b.buffer_id);
  });

  const bool all_here = std::all_of(pieces.begin(), pieces.end(),
                                    [](const Piece& p) { return p.node.empty() || p.slot; });
  if (model.destinations.empty()) {
    // A node with neither sources nor destinations of the model has nothing to complete (unless
    // every byte was imported); once an engine registers its destinations the newest announced
    // version is pulled for them.
    if (model.sources.empty() && !all_here) return;
    // A trainer node: complete without holding the other nodes' bytes.
    CompleteVersion(model, candidate, std::move(pieces));
    return;
  }
  // Which bytes of the other nodes' pieces do the local destinations need?
  Version draft;
  draft.number = candidate;
  draft.pieces = pieces;
  for (const Piece& piece : pieces) {
    absl::StrAppend(&draft.layout_key, draft.layout_key.empty() ? "" : ",", piece.node, "/",
                    piece.buffer_id);
  }
  std::vector<std::shared_ptr<Buffer>> dests;
  for (const std::string& id : model.destinations) {
    // A destination that disagrees with the sources is left out: it never gets a plan.
    if (buffers_.at(id)->refused.empty()) dests.push_back(buffers_.at(id));
  }
  if (dests.empty()) return;
  auto cached = PlanFor(model, draft, dests);
  if (!cached.ok()) {
    Logger("store")->warn("model={} version={} cannot be planned: {}", model.name, candidate,
                          cached.status().ToString());
    model.failed = candidate;
    model.failed_status = cached.status();
    return;
  }
  if (all_here) {
    CompleteVersion(model, candidate, std::move(pieces));
    return;
  }
  std::vector<ByteRanges> needed(pieces.size());
  for (const plan::CopyOp& op : (*cached)->Reads().ops) {
    const Piece& piece = pieces[op.src_location];
    if (!piece.node.empty() && !piece.slot) AppendSourceRuns(op, &needed[op.src_location]);
  }
  PullJob job;
  job.model = model.name;
  job.version = candidate;
  job.run = model.run;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].node.empty() || pieces[i].slot) continue;
    MergeRanges(&needed[i]);
    const auto& layout = remotes.at(pieces[i].node).sources;
    uint64_t bytes = 0;
    for (const SourceLayout& l : layout) {
      if (l.buffer_id == pieces[i].buffer_id) bytes = l.bytes;
    }
    job.fetches.push_back({pieces[i].node,
                           pieces[i].buffer_id,
                           pieces[i].remote_key,
                           bytes,
                           needed[i],
                           nullptr,
                           0,
                           {}});
    OfferDelta(model, candidate, &job.fetches.back());
  }
  uint64_t staging = 0;
  for (const PullJob::Fetch& fetch : job.fetches) staging += fetch.bytes;
  if (absl::Status fits = CheckPullFits(model, candidate, staging); !fits.ok()) {
    // Refused before anything is pulled; a newer version is tried when it is announced.
    Logger("store")->error("model={} version={} abandoned, staying on version {}: {}", model.name,
                           candidate, model.latest, fits.ToString());
    model.failed = candidate;
    model.failed_status = std::move(fits);
    counters_.versions_abandoned.Add(1);
    changed_.NotifyAll();
    return;
  }
  model.pulling = candidate;
  model.pulling_changed.clear();
  std::set<uint64_t> sizes;
  for (const PullJob::Fetch& fetch : job.fetches) sizes.insert(fetch.bytes);
  budget_.SetStaging(model.name, std::move(sizes));
  model.pulling_pieces = std::move(pieces);
  Logger("store")->info("model={} version={} pulling {} bytes from {} pieces", model.name,
                        candidate, job.Bytes(), job.fetches.size());
  for (StoreEvents* listener : listeners_) listener->OnPullNeeded(job);
}

void Store::OfferDelta(const Model& model, uint64_t version, PullJob::Fetch* fetch) const {
  if (model.latest == 0) return;
  auto held = model.complete.find(model.latest);
  if (held == model.complete.end()) return;
  // Deltas chain versions of one run; numbers of another run name other bytes.
  if (held->second->run != model.run) return;
  // The newest version held here must hold every byte this pull needs, from the same piece.
  const Piece* base = nullptr;
  for (const Piece& piece : held->second->pieces) {
    if (piece.node == fetch->node && piece.buffer_id == fetch->buffer_id) base = &piece;
  }
  if (base && base->released) {
    // --delta-base=destination: the DESTINATION buffers hold that version instead.
    if (!CanUseDestinationBase(model, *base, *fetch)) return;
  } else if (!base || !base->slot || base->slot->size() != fetch->bytes) {
    return;
  } else if (base->valid) {
    for (const auto& [begin, end] : fetch->ranges) {
      auto it = std::upper_bound(base->valid->begin(), base->valid->end(),
                                 std::make_pair(begin, UINT64_MAX));
      if (it == base->valid->begin()) return;
      --it;
      if (it->first > begin || it->second < end) return;
    }
  }
  // A chain of deltas from that version to `version`.
  std::vector<RemoteDeltaRef> chain =
      remotes_.DeltaChain(model.name, fetch->node, fetch->buffer_id, model.latest, version);
  if (chain.empty()) return;
  fetch->destination_base = base->released;
  fetch->base = base->slot;
  fetch->base_version = model.latest;
  fetch->deltas = std::move(chain);
}

void Store::NoteDeltaChanges(const PullJob& job, size_t fetch,
                             std::shared_ptr<const ChangeList> changes) {
  if (fetch >= job.fetches.size() || !changes) return;
  common::MutexLock lock(mu_);
  Model* model = FindModel(job.model);
  if (!model || model->pulling != job.version || model->run != job.run) return;
  model->pulling_changed[fetch] = {job.fetches[fetch].base_version, std::move(changes)};
}

void Store::FinishPull(const PullJob& job, absl::Status result,
                       std::vector<std::shared_ptr<Region>> staging) {
  // Sparse Apply: what changed since the version this node's destinations were given, found
  // before the version completes, outside the store lock (store_sparse.cc). A piece that
  // deltas from that very version built takes the change list they gathered (no diff).
  std::vector<Piece> diffed(staging.size());
  std::shared_ptr<const Version> diff_base;
  std::vector<std::shared_ptr<const ChangeList>> gathered(staging.size());
  if (result.ok() && staging.size() == job.fetches.size()) {
    {
      common::MutexLock lock(mu_);
      const Model* model = FindModel(job.model);
      if (model && model->pulling == job.version && model->run == job.run) {
        diff_base = DiffBaseFor(*model);
        for (const auto& [f, changes] : model->pulling_changed) {
          if (diff_base && f < gathered.size() && changes.first == diff_base->number) {
            gathered[f] = changes.second;
          }
        }
      }
    }
    if (diff_base) {
      const auto started = std::chrono::steady_clock::now();
      std::vector<Piece*> pieces;
      size_t taken = 0;
      for (size_t f = 0; f < staging.size(); ++f) {
        diffed[f].node = job.fetches[f].node;
        diffed[f].buffer_id = job.fetches[f].buffer_id;
        diffed[f].slot = staging[f];
        diffed[f].valid = std::make_shared<const ByteRanges>(job.fetches[f].ranges);
        if (gathered[f] && TakeGatheredChanges(&diffed[f], gathered[f], *diff_base)) {
          ++taken;
        } else {
          pieces.push_back(&diffed[f]);
        }
      }
      DiffPieces(pieces, *diff_base);
      Logger("store")->debug(
          "model={} version={}: changes since version {} for a sparse Apply in {:.4f} s ({} of "
          "{} piece(s) from their deltas, the rest diffed)",
          job.model, job.version, diff_base->number,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), taken,
          staging.size());
    }
  }
  common::MutexLock lock(mu_);
  Model* model = FindModel(job.model);
  // A pull of a run the model left since (StartRun) is dropped.
  if (!model || model->pulling != job.version || model->run != job.run) return;
  model->pulling = 0;
  model->pulling_changed.clear();
  budget_.EndStaging(model->name);
  std::vector<Piece> pieces = std::move(model->pulling_pieces);
  model->pulling_pieces.clear();
  if (!result.ok() || staging.size() != job.fetches.size()) {
    Logger("store")->error("model={} version={} abandoned, staying on version {}: {}", job.model,
                           job.version, model->latest, result.ToString());
    model->failed = job.version;
    model->failed_status = result.ok() ? absl::InternalError("a pull returned no staging") : result;
    counters_.versions_abandoned.Add(1);
    model->pending.erase(job.version);
    model->early_quant.erase(job.version);  // blocks quantized as they landed go with it
    changed_.NotifyAll();
    // A newer version announced during the pull waited for it to end: take it now, rather
    // than at the next announcement (which may never come).
    TryComplete(*model);
    return;
  }
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    for (Piece& piece : pieces) {
      if (piece.node == job.fetches[f].node && piece.buffer_id == job.fetches[f].buffer_id) {
        piece.slot = staging[f];
        // The staging slot becomes a held one.
        budget_.host()->Adopt(piece.slot.get(), model->name);
        piece.valid = std::make_shared<const ByteRanges>(job.fetches[f].ranges);
        // Diffed against the version that was newest then; Apply checks the destinations
        // hold that one.
        piece.changes = std::move(diffed[f].changes);
        piece.changes_base = diffed[f].changes_base;
        piece.compared_bytes = diffed[f].compared_bytes;
      }
    }
  }
  CompleteVersion(*model, job.version, std::move(pieces));
  TryComplete(*model);  // a newer version may have been announced meanwhile
}

std::map<std::string, std::vector<SourceLayout>> Store::LocalSourceLayouts() const {
  common::MutexLock lock(mu_);
  std::map<std::string, std::vector<SourceLayout>> out;
  for (const auto& [name, model] : models_) {
    for (const std::string& id : model->sources) {
      const Buffer& b = *buffers_.at(id);
      out[name].push_back({id, b.snapshot_slices, b.span_end - b.span_begin});
    }
  }
  return out;
}

uint64_t Store::LatestLocalSnapshot(const std::string& model_name) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  if (!model || model->snapshots.empty()) return 0;
  return model->snapshots.rbegin()->first;
}

absl::StatusOr<std::shared_ptr<const LocalSnapshot>> Store::GetLocalSnapshot(
    const std::string& model_name, uint64_t version) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  if (model) {
    auto it = model->snapshots.find(version);
    if (it != model->snapshots.end()) return it->second;
  }
  return absl::NotFoundError(
      absl::StrCat("model ", model_name, ": version ", version, " is not held here"));
}

void Store::ImportVersion(const std::string& node, const std::string& model_name, uint64_t version,
                          std::vector<SourceLayout> layouts,
                          std::vector<std::shared_ptr<Region>> slots) {
  common::MutexLock lock(mu_);
  auto& model = models_[model_name];
  if (!model) {
    model = std::make_unique<Model>();
    model->name = model_name;
    SeedHold(*model);
  }
  if (!remotes_.Import(model_name, node, version, std::move(layouts), std::move(slots))) {
    model->plans.clear();
  }
  RecheckDestinations(*model);
  UpdateBudget(*model);
  TryComplete(*model);
}

void Store::ReserveStaging(const std::string& model_name) {
  std::vector<uint64_t> sizes;
  {
    common::MutexLock lock(mu_);
    Model* model = FindModel(model_name);
    if (!model || model->destinations.empty()) return;
    std::string key;
    for (const auto& [node, remote] : remotes_.Of(model_name)) {
      for (const SourceLayout& l : remote.sources) {
        if (remote.imported.count(l.buffer_id)) continue;  // a bucket hands over its own slots
        // Reserved ahead only for what the layout's slices can fill: a peer's layout may claim
        // a region far larger than its slices (a hostile one: terabytes), and reserving that
        // here, on the peer's stream thread, would fault it in. A pull still gets its slots
        // (under --max-slot-memory) when it runs; this is only the head start.
        uint64_t carried = 0;
        if (l.slices) {
          for (const TensorSlice& slice : *l.slices) {
            carried += slice.NumElements() * DTypeSize(slice.dtype);
          }
        }
        if (l.bytes > 2 * carried + (1ull << 20)) continue;
        sizes.push_back(l.bytes);
        absl::StrAppend(&key, node, "/", l.buffer_id, ":", l.bytes, ",");
      }
    }
    if (sizes.empty() || key == model->staging_reserved) return;
    model->staging_reserved = key;
  }
  // Outside the lock (this faults memory in): the slots pulls will stage into, so that the
  // first versions after a start don't pay for it. A failure only means they will.
  // With the destinations as the delta base the node stages one version at a time.
  const int count = DeltaBaseOf(model_name) == DeltaBase::kDestination
                        ? 1
                        : static_cast<int>(options_.retain) + 1;
  for (uint64_t size : sizes) {
    (void)budget_.host()->Reserve(size, count, model_name);
  }
}

void Store::SetRemoteSources(const std::string& node, const std::string& model_name,
                             std::vector<SourceLayout> sources) {
  common::MutexLock lock(mu_);
  auto& model = models_[model_name];
  if (!model) {
    model = std::make_unique<Model>();
    model->name = model_name;
    SeedHold(*model);
  }
  remotes_.SetSources(model_name, node, std::move(sources));
  model->plans.clear();
  RecheckDestinations(*model);
  UpdateBudget(*model);
  TryComplete(*model);
  EraseIfEmpty(model_name);  // that node's last source of a model nothing else holds went away
}

void Store::AnnounceRemoteVersion(const std::string& node, const std::string& model_name,
                                  uint64_t version, std::vector<RemotePieceRef> pieces,
                                  std::vector<RemoteDeltaRef> deltas, const std::string& run,
                                  const std::string& trainer_run) {
  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model) return;
  if (!trainer_run.empty() && trainer_run != model->run &&
      std::find(model->past_runs.begin(), model->past_runs.end(), trainer_run) ==
          model->past_runs.end()) {
    // The trainer started a new run (or resumed from a checkpoint): follow it, even below the
    // version held here.
    StartRun(*model, trainer_run, absl::StrCat("node ", node, " announced it"));
  }
  const uint64_t before = remotes_.Announce(model_name, node, version, std::move(pieces),
                                            std::move(deltas), run, trainer_run);
  if (before == 0 && version >= model->failed) model->failed = 0;  // a fresh start
  // A number this node already has from another run of that node: the numbers were reused
  // (its refitd restarted without --state-dir, or its model was dropped). Never silently.
  auto held_run = model->latest_runs.find(node);
  if (version <= model->latest && held_run != model->latest_runs.end() && !run.empty() &&
      held_run->second != run && version != model->skipped) {
    model->skipped = version;
    model->skipped_reason = absl::StrCat(
        "node ", node, " announced version ", version,
        " from a new run (its refitd restarted, "
        "or the model was dropped there), and this node holds version ",
        model->latest,
        " of the previous run: numbers were reused, so the version is not taken; publish a "
        "version above ",
        model->latest,
        " (run refitd with --state-dir on the trainer's node "
        "so that it refuses reused numbers), or release this node's buffers of ",
        model_name, " and `refitctl drop ", model_name, "` here to follow the new run");
    Logger("store")->warn("model={} version={} skipped: {}", model_name, version,
                          model->skipped_reason);
  }
  TryComplete(*model);
}

void Store::ForgetRemoteVersions(const std::string& node) {
  remotes_.Forget(node);  // the view's lock alone
}

void Store::NoteChecksumRanges(const std::string& buffer_id, uint64_t piece_bytes,
                               const std::vector<RangeRun>& runs) {
  std::shared_ptr<Buffer> buffer;
  {
    common::MutexLock lock(mu_);
    auto it = buffers_.find(buffer_id);
    if (it == buffers_.end() || it->second->role != Role::kSource) return;
    buffer = it->second;
  }
  buffer->hints.Note(piece_bytes, runs);  // its own lock; the store's is not held
}

}  // namespace refit
