#include "daemon/store/store.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/common/names.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/test_hooks.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/plan.h"
#include "daemon/plan/scales.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

constexpr size_t kHistoryLength = 4096;  // completed versions remembered for Watch
constexpr auto kWaitSlice = std::chrono::milliseconds(50);  // re-check of `cancelled`

// `options`, or an abort naming what is missing (CheckStoreOptions).
StoreOptions Checked(StoreOptions options) {
  if (absl::Status checked = CheckStoreOptions(options); !checked.ok()) {
    Logger("store")->critical("Store: {}", std::string(checked.message()));
    std::abort();
  }
  return options;
}

}  // namespace

absl::Status CheckStoreOptions(const StoreOptions& options) {
  if (options.retain < 1) {
    return absl::InvalidArgumentError(
        "StoreOptions::retain is 0: set it from --retain (DaemonOptions::retain, >= 1)");
  }
  if (options.node.empty()) {
    return absl::InvalidArgumentError(
        "StoreOptions::node is empty: set it from --node (DaemonOptions::node)");
  }
  return absl::OkStatus();
}

void Store::Probe() {
  common::MutexLock lock(mu_);
  TestHookWedge("store");
}

Store::Store(StoreOptions options, Metrics* metrics)
    : options_(Checked(std::move(options))),
      delta_base_(options_.delta_base, options_.delta_base_models),
      metrics_(metrics),
      counters_(metrics),
      budget_(
          SlotBudget::Options{options_.retain, options_.max_spare_slot_bytes, options_.slot_memory,
                              options_.slot_device, options_.host_slot_allocator,
                              options_.max_slot_bytes, options_.max_gpu_slot_bytes},
          metrics) {
  auto journal = ApplyJournal::Open(options_.journal_dir);
  if (!journal.ok()) {
    Logger("store")->error("{}: Apply's undo journal is kept in memory (a kill is not undone)",
                           journal.status().ToString());
    journal = ApplyJournal::Open("");
  }
  journal_ = std::move(journal).value();
  prepare_loop_.Start([this] { RunPrepares(); });
}

Store::Counters::Counters(Metrics* metrics)
    : versions_completed(metrics->Declare(kVersionsCompleted)),
      apply_bytes(metrics->Declare(kApplyBytes)),
      apply_undo_bytes(metrics->Declare(kApplyUndoBytes)),
      apply_sparse(metrics->Declare(kApplySparse)),
      apply_sparse_prepared(metrics->Declare(kApplySparsePrepared)),
      diff_bytes(metrics->Declare(kDiffBytes)),
      publish_bytes(metrics->Declare(kPublishBytes)),
      publishes(metrics->Declare(kPublishes)),
      applies(metrics->Declare(kApplies)),
      versions_dropped(metrics->Declare(kVersionsDropped)),
      versions_abandoned(metrics->Declare(kVersionsAbandoned)),
      apply_verify_failures(metrics->Declare(kApplyVerifyFailures)),
      delta_base_fallbacks(metrics->Declare(kDeltaBaseFallbacks)),
      quantized_values(metrics->Declare(kQuantizedValues)),
      quantized_gpu_values(metrics->Declare(kQuantizedGpuValues)),
      nonfinite_values(metrics->Declare(kNonfiniteValues)),
      sparse_prepared_bytes(metrics->Declare(kSparsePreparedBytes)),
      publish_seconds(metrics->Declare(kPublishSeconds)),
      apply_seconds(metrics->Declare(kApplySeconds)),
      plan_seconds(metrics->Declare(kPlanSeconds)),
      quantize_seconds(metrics->Declare(kQuantizeSeconds)) {}

Store::~Store() {
  Shutdown();
  prepare_loop_.Stop();
  quant_queue_.Stop();
}

Store::Model* Store::FindModel(const std::string& name) {
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second.get();
}

const Store::Model* Store::FindModel(const std::string& name) const {
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second.get();
}

absl::StatusOr<std::vector<std::shared_ptr<Store::Buffer>>> Store::LookUpBuffers(
    const std::string& model, Role role, const std::vector<std::string>& ids) const {
  if (ids.empty()) return absl::InvalidArgumentError("no buffer_ids given");
  std::set<std::string> seen;
  std::vector<std::shared_ptr<Buffer>> out;
  for (const std::string& id : ids) {
    auto it = buffers_.find(id);
    if (it == buffers_.end()) {
      return absl::NotFoundError(absl::StrCat("buffer ", id, " does not exist"));
    }
    const Buffer& buffer = *it->second;
    if (buffer.model != model) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffer ", id, " belongs to model ", buffer.model, ", not ", model));
    }
    if (buffer.role != role) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", id, " is a ", RoleName(buffer.role),
                                                     " buffer, not a ", RoleName(role), " buffer"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", id, " is listed twice"));
    }
    out.push_back(it->second);
  }
  return out;
}

absl::Status Store::MemoryWentAway(const Buffer& buffer, const std::string& more) {
  Logger("store")->warn("buffer={} model={} client={}: its memory went away under refitd ({})",
                        buffer.id, buffer.model, buffer.client, buffer.region->Describe());
  return absl::FailedPreconditionError(
      absl::StrCat("buffer ", buffer.id, " (", buffer.region->Describe(),
                   "): its memory went away while refitd used it (the shm object was truncated or "
                   "shrunk)",
                   more, "; nothing else changed: release the buffer and register it again"));
}

absl::Status Store::SnapshotBuffer(Buffer& buffer, Piece* piece, PublishTimes* times) {
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const uint64_t size = buffer.span_end - buffer.span_begin;
  piece->buffer_id = buffer.id;
  piece->slices = buffer.snapshot_slices;
  auto phase = Clock::now();
  ASSIGN_OR_RETURN(piece->slot,
                   (budget_.gpu() ? budget_.gpu() : budget_.host())->Acquire(size, buffer.model));
  if (budget_.gpu()) {
    ASSIGN_OR_RETURN(piece->host, budget_.host()->Acquire(size, buffer.model));
  }
  times->acquire += since(phase);
  common::MutexLock io(buffer.io_mu);
  const Region& from = *buffer.region;
  if (from.Broken()) return MemoryWentAway(buffer, "");
  // Host to host: copy and checksum in one pass over the cores, each block hashed while it is
  // still in cache. Otherwise hash what peers will read once it is there.
  phase = Clock::now();
  if (from.kind() == MemoryKind::kHost && piece->slot->kind() == MemoryKind::kHost) {
    const auto hints = buffer.hints.ForPublish(size);
    auto range_sums = std::make_shared<RangeSums>();
    piece->xxh3 = std::make_shared<const std::vector<uint64_t>>(CopyAndHash(
        piece->slot->data(), from.data() + buffer.span_begin, size, *hints, range_sums.get()));
    if (range_sums->size() > 0) piece->range_xxh3 = std::move(range_sums);
  } else {
    RETURN_IF_ERROR(cuda::Copy(*piece->slot, 0, from, buffer.span_begin, size));
  }
  times->copy += since(phase);
  phase = Clock::now();
  // The mirror comes from the slot, not the client's buffer: the buffer may change as soon as
  // Publish returns.
  if (piece->host) RETURN_IF_ERROR(cuda::Copy(*piece->host, 0, *piece->slot, 0, size));
  times->mirror += since(phase);
  phase = Clock::now();
  // A client that shrank its memory while it was copied: the slot holds zeros from there on,
  // not the client's bytes. Nothing of it is kept.
  if (from.Broken()) return MemoryWentAway(buffer, "");
  if (!piece->xxh3) {
    const Region& served = piece->host ? *piece->host : *piece->slot;
    if (served.kind() == MemoryKind::kHost) {
      piece->xxh3 = std::make_shared<const std::vector<uint64_t>>(HashChunks(served.data(), size));
    }
  }
  times->hash += since(phase);
  return absl::OkStatus();
}

absl::Status Store::SnapshotBuffers(const std::vector<std::shared_ptr<Buffer>>& buffers,
                                    std::vector<Piece>* pieces, uint64_t* bytes,
                                    PublishTimes* times) {
  // A buffer under common::kParallelBytes is copied and hashed on one core (more threads would
  // cost more than they give), so a trainer whose memory is many such buffers (torch's caching
  // allocator hands out 20 MiB blocks: 51 of them for a 1 GiB model on an H200, hashed one
  // after another in 0.072 s) gets several of them snapshotted at once; larger ones go one
  // after another, each spread over the cores.
  const size_t n = buffers.size();
  std::vector<Piece> made(n);
  std::vector<absl::Status> status(n);
  std::vector<PublishTimes> part(n);
  std::vector<size_t> small, large;
  uint64_t small_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t size = buffers[i]->span_end - buffers[i]->span_begin;
    if (size < common::kParallelBytes) {
      small.push_back(i);
      small_bytes += size;
    } else {
      large.push_back(i);
    }
  }
  common::ParallelFor(small.size(), common::ThreadsFor(small_bytes, small.size()), [&](size_t k) {
    const size_t i = small[k];
    status[i] = SnapshotBuffer(*buffers[i], &made[i], &part[i]);
  });
  for (size_t i : large) status[i] = SnapshotBuffer(*buffers[i], &made[i], &part[i]);
  for (const absl::Status& s : status) RETURN_IF_ERROR(s);
  for (size_t i = 0; i < n; ++i) {
    *bytes += buffers[i]->span_end - buffers[i]->span_begin;
    pieces->push_back(std::move(made[i]));
    times->acquire += part[i].acquire;
    times->copy += part[i].copy;
    times->mirror += part[i].mirror;
    times->hash += part[i].hash;
  }
  return absl::OkStatus();
}

absl::StatusOr<PublishResult> Store::Publish(const std::string& model_name, uint64_t version,
                                             const std::vector<std::string>& buffer_ids,
                                             const std::string& run_asked) {
  std::shared_ptr<const Version> diff_base;
  std::string run;  // the run this version belongs to
  if (version == 0) return absl::InvalidArgumentError("version must be >= 1");
  std::vector<std::shared_ptr<Buffer>> buffers;
  std::vector<uint64_t> previous;  // each buffer's last published version before this call
  {
    common::MutexLock lock(mu_);
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
    Model* model = FindModel(model_name);
    if (!model) return absl::NotFoundError(absl::StrCat("model ", model_name, " does not exist"));
    ASSIGN_OR_RETURN(buffers, LookUpBuffers(model_name, Role::kSource, buffer_ids));
    if (!run_asked.empty() && run_asked != model->run) {
      if (std::find(model->past_runs.begin(), model->past_runs.end(), run_asked) !=
          model->past_runs.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("model ", model_name, ": run ", run_asked, " was replaced by run ",
                         model->run, "; publish under the current run or a new one"));
      }
      StartRun(*model, run_asked, "a Publish named it");
    }
    run = model->run;
    if (version <= model->latest) {
      return absl::FailedPreconditionError(
          absl::StrCat("model ", model_name, ": version ", version,
                       " is not newer than the latest complete version ", model->latest));
    }
    for (const auto& buffer : buffers) {
      if (version <= buffer->last_published) {
        return absl::FailedPreconditionError(
            absl::StrCat("buffer ", buffer->id, ": version ", version,
                         " is not newer than its last published version ", buffer->last_published));
      }
    }
    // Reserve the version so a concurrent Publish of the same buffer can't take it too.
    for (const auto& buffer : buffers) {
      previous.push_back(buffer->last_published);
      buffer->last_published = version;
    }
    diff_base = DiffBaseFor(*model);  // engines on this node: sparse Apply (store_sparse.cc)
  }

  // Snapshot outside the store lock: other models and readers keep going meanwhile.
  const auto started = Clock::now();
  std::vector<Piece> pieces;
  uint64_t bytes = 0;
  PublishTimes times;
  absl::Status snapped = SnapshotBuffers(buffers, &pieces, &bytes, &times);
  if (!snapped.ok()) {
    // A refused Publish changes nothing: the buffers may publish this version again.
    common::MutexLock lock(mu_);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i]->last_published == version) buffers[i]->last_published = previous[i];
    }
    return snapped;
  }
  TestHookKillAt("publish");  // test build only: the fault suite's commit point
  if (diff_base) {
    const auto diff_started = Clock::now();
    std::vector<Piece*> diffed;
    for (Piece& piece : pieces) diffed.push_back(&piece);
    DiffPieces(std::move(diffed), *diff_base);
    times.diff = std::chrono::duration<double>(Clock::now() - diff_started).count();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  counters_.publish_bytes.Add(static_cast<double>(bytes));
  counters_.publishes.Add(1);
  counters_.publish_seconds.Observe(seconds);
  Logger("store")->debug(
      "model={} version={} published {} bytes from {} buffer(s) in {:.4f} s: slots {:.4f}, copy "
      "{:.4f}, mirror {:.4f}, hash {:.4f}, diff {:.4f}",
      model_name, version, bytes, buffers.size(), seconds, times.acquire, times.copy, times.mirror,
      times.hash, times.diff);

  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model) {
    return absl::FailedPreconditionError(absl::StrCat("model ", model_name,
                                                      ": its buffers were released while version ",
                                                      version, " was being published"));
  }
  if (model->run != run) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_name, ": run ", run, " was replaced by run ", model->run,
                     " while version ", version, " was being published"));
  }
  if (version <= model->latest) {
    // Another buffer's publish completed a newer version meanwhile; this one can't complete.
    return absl::FailedPreconditionError(absl::StrCat("model ", model_name, ": version ", version,
                                                      " was overtaken by version ", model->latest));
  }
  auto& pending = model->pending[version];
  for (Piece& piece : pieces) pending[piece.buffer_id] = std::move(piece);
  QuantizeEarly(*model, version);
  TryComplete(*model);
  // Bound the memory held by versions some source never finishes.
  const size_t max_pending = std::max<size_t>(4, 2 * options_.retain);
  while (model->pending.size() > max_pending) {
    Logger("store")->warn("model={} version={} dropped: not every source published it", model_name,
                          model->pending.begin()->first);
    model->early_quant.erase(model->pending.begin()->first);
    model->pending.erase(model->pending.begin());
  }
  return PublishResult{version, bytes};
}

void Store::TryComplete(Model& model) {
  NoteLocalReady(model);
  if (model.finishing != 0) return;  // the quantizer calls again when it is done
  if (HasRemoteSources(model)) {
    TryCompleteWithRemotes(model);
    return;
  }
  if (model.sources.empty()) return;
  uint64_t newest_ready = 0;
  for (const auto& [version, pieces] : model.pending) {
    bool ready = std::all_of(model.sources.begin(), model.sources.end(),
                             [&p = pieces](const std::string& id) { return p.count(id) > 0; });
    if (ready) newest_ready = version;
  }
  if (newest_ready == 0) return;
  std::vector<Piece> pieces;
  for (auto& [id, piece] : model.pending[newest_ready]) pieces.push_back(std::move(piece));
  CompleteVersion(model, newest_ready, std::move(pieces));
}

void Store::CompleteVersion(Model& model, uint64_t number, std::vector<Piece> pieces) {
  auto version = std::make_shared<Version>();
  version->number = number;
  version->run = model.run;
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return std::tie(a.node, a.buffer_id) < std::tie(b.node, b.buffer_id);
  });
  std::vector<std::string> ids;
  for (Piece& piece : pieces) {
    ids.push_back(piece.node + "/" + piece.buffer_id);
    if (piece.slot) version->bytes += piece.slot->size();
    version->pieces.push_back(std::move(piece));
  }
  version->layout_key = absl::StrJoin(ids, ",");
  // Older pending versions can never complete now: versions only move forward.
  model.pending.erase(model.pending.begin(), model.pending.upper_bound(number));
  auto early = model.early_quant.find(number);
  if (early != model.early_quant.end()) version->quant = early->second;  // partly done
  model.early_quant.erase(model.early_quant.begin(), model.early_quant.upper_bound(number));
  if (model.HasScales()) {
    // fp8 destinations with scales: quantize first, so that Apply stays a copy.
    model.finishing = number;
    quant_queue_.Push({model.name, std::move(version), /*early=*/false});
    return;
  }
  PublishVersion(model, std::move(version));
}

void Store::PublishVersion(Model& model, std::shared_ptr<const Version> version) {
  const uint64_t number = version->number;
  model.complete[number] = version;
  model.latest = number;
  model.latest_runs.clear();
  const RemoteView::Nodes remotes = remotes_.Of(model.name);
  for (const Piece& piece : version->pieces) {
    if (piece.node.empty()) continue;
    auto remote = remotes.find(piece.node);
    if (remote != remotes.end()) model.latest_runs[piece.node] = remote->second.run;
  }
  model.history.push_back(number);
  if (model.history.size() > kHistoryLength) model.history.pop_front();
  // A rollback target stays held beside the --retain newest until Resume.
  while (model.complete.size() > std::max<uint32_t>(1, options_.retain) + (model.hold ? 1 : 0)) {
    auto oldest = model.complete.begin();
    if (oldest->first == model.hold) ++oldest;
    model.complete.erase(oldest);  // slots freed once no Apply holds them
    counters_.versions_dropped.Add(1);
  }
  if (model.hold == 0) AddEvent(model, number, false);  // held back until Resume otherwise
  counters_.versions_completed.Add(1);
  Logger("store")->info("model={} version={} complete: {} pieces, {} bytes held here", model.name,
                        number, version->pieces.size(), version->bytes);
  for (StoreEvents* listener : listeners_) listener->OnVersionComplete(model.name, number);
  QueuePrepares(model);  // the engines' next sparse Apply, collected while they generate
  changed_.NotifyAll();
}

absl::StatusOr<std::shared_ptr<const Store::CachedPlan>> Store::PlanFor(
    Model& model, const Version& version, const std::vector<std::shared_ptr<Buffer>>& dests) {
  const std::string key = absl::StrCat(version.layout_key, "|", GroupKey(dests));
  auto it = model.plans.find(key);
  if (it != model.plans.end()) return it->second;

  // Node 0 is this node; other nodes get 1, 2, ... in name order (pieces are sorted by node).
  std::vector<plan::PlacedSlice> sources;
  uint32_t node_index = 0;
  for (uint32_t i = 0; i < version.pieces.size(); ++i) {
    if (i > 0 && version.pieces[i].node != version.pieces[i - 1].node) ++node_index;
    const uint32_t node = version.pieces[i].node.empty() ? 0 : node_index + 1;
    for (const TensorSlice& s : *version.pieces[i].slices) sources.push_back({&s, i, node});
  }
  std::vector<plan::PlacedSlice> destinations;
  for (uint32_t j = 0; j < dests.size(); ++j) {
    for (const TensorSlice& s : dests[j]->slices) destinations.push_back({&s, j, 0});
  }
  const auto started = Clock::now();
  plan::PlanOptions plan_options;
  plan_options.multi_row_ops = true;  // one op per strided box, not per row: small, fast plans
  plan_options.local_node = 0;        // replicas held here beat replicas elsewhere
  auto cached = std::make_shared<CachedPlan>();
  std::vector<const TensorSlice*> dest_slices;
  for (const plan::PlacedSlice& d : destinations) dest_slices.push_back(d.slice);
  if (model.HasScales()) {
    // The jobs of these destinations, as the model's batch places them in its slot (one plan
    // location), each once.
    std::vector<const std::vector<TensorSlice>*> layout;
    for (const Piece& piece : version.pieces) layout.push_back(piece.slices.get());
    cached->batch = QuantBatchFor(model, version.layout_key, layout);
    std::vector<char> taken(cached->batch->jobs().size(), 0);
    for (const TensorSlice* s : dest_slices) {
      if (!plan::IsScaled(*s)) continue;
      const QuantJob* job = cached->batch->JobOf(s);
      if (!job) return absl::InternalError(absl::StrCat("no quantization of ", s->name));
      const size_t index = static_cast<size_t>(job - cached->batch->jobs().data());
      if (!taken[index]) cached->jobs.push_back(job);
      taken[index] = 1;
    }
  }
  if (cached->jobs.empty() && !model.HasScales()) {
    ASSIGN_OR_RETURN(cached->plan, plan::BuildPlan(sources, destinations, plan_options));
  } else {
    ASSIGN_OR_RETURN(std::tie(cached->plan, cached->reads),
                     QuantPlans(model, version, sources, destinations, *cached, plan_options));
  }
  cached->dst_extents = DestinationExtents(cached->plan, dests.size());
  counters_.plan_seconds.Observe(std::chrono::duration<double>(Clock::now() - started).count());
  model.plans[key] = cached;
  return std::shared_ptr<const CachedPlan>(cached);
}

template <typename Ready>
absl::Status Store::WaitUntil(common::UniqueLock& lock, Clock::time_point deadline,
                              const CancelledFn& cancelled, Ready ready) {
  while (true) {
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
    if (ready()) return absl::OkStatus();
    if (cancelled && cancelled()) return absl::CancelledError("the caller went away");
    const auto now = Clock::now();
    if (now >= deadline) return absl::DeadlineExceededError("deadline passed while waiting");
    changed_.WaitUntil(lock, std::min(deadline, now + kWaitSlice));
  }
}

absl::StatusOr<uint64_t> Store::WaitForVersion(const std::string& model_name, uint64_t min_version,
                                               Clock::time_point deadline,
                                               const CancelledFn& cancelled) {
  auto target = WaitForTarget(model_name, min_version, "", deadline, cancelled);
  if (!target.ok()) return target.status();
  return target->version;
}

absl::StatusOr<VersionTarget> Store::WaitForTarget(const std::string& model_name,
                                                   uint64_t min_version, const std::string& run,
                                                   Clock::time_point deadline,
                                                   const CancelledFn& cancelled, uint64_t applied) {
  common::UniqueLock lock(mu_);
  uint64_t latest = 0;
  VersionTarget out;
  std::optional<std::string> run_at_start;
  if (const Model* model = FindModel(model_name)) run_at_start = model->run;
  absl::Status status =
      WaitUntil(lock, deadline, cancelled, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const Model* model = FindModel(model_name);
        latest = model ? TargetOf(*model) : 0;
        if (latest == 0) return false;
        out.version = latest;
        out.rollback = model->hold != 0;
        out.run = model->run;
        // A new run (or a resume from a checkpoint) restarts its numbers: the caller hears of
        // its versions even below min_version, never waits past them.
        const bool new_run =
            (!run.empty() && model->run != run) || (run_at_start && *run_at_start != model->run);
        // An engine on another version than the rollback's hears it must go back.
        const bool go_back = model->hold != 0 && applied != 0 && applied != model->hold;
        return latest >= min_version || new_run || go_back;
      });
  if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    const Model* model = FindModel(model_name);
    if (!model || (model->sources.empty() && !HasRemoteSources(*model) && latest == 0)) {
      std::vector<std::string> known;
      for (const auto& [name, m] : models_) known.push_back(name);
      return absl::DeadlineExceededError(absl::StrCat(
          "model ", model_name, ": no version >= ", min_version,
          " before the deadline, and none will come: no node has SOURCE buffers for ", model_name,
          " (not this one, nor any connected peer)", KnownModelsHint(model_name, known),
          "; check the model name and that the trainer's node is in --peers"));
    }
    std::string abandoned;
    if (model && model->failed >= min_version && model->failed > latest) {
      abandoned = absl::StrCat("; ", model->failed_status.message());
    }
    return absl::DeadlineExceededError(
        absl::StrCat("model ", model_name, ": no version >= ", min_version,
                     " completed before the deadline (latest: ", latest, ")", abandoned));
  }
  RETURN_IF_ERROR(status);
  return out;
}

absl::StatusOr<std::vector<uint64_t>> Store::WaitForCompletions(const std::string& model_name,
                                                                uint64_t after_version,
                                                                Clock::time_point deadline,
                                                                const CancelledFn& cancelled) {
  common::UniqueLock lock(mu_);
  std::vector<uint64_t> out;
  RETURN_IF_ERROR(WaitUntil(lock, deadline, cancelled, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Model* model = FindModel(model_name);
    if (!model || model->latest <= after_version) return false;
    for (uint64_t v : model->history) {
      if (v > after_version) out.push_back(v);
    }
    return true;
  }));
  return out;
}

uint64_t Store::LatestVersion(const std::string& model_name) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  return model ? model->latest : 0;
}

std::vector<std::string> Store::ModelNames() const {
  common::MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, model] : models_) out.push_back(name);
  return out;
}

void Store::EraseIfEmpty(const std::string& name) {
  const Model* model = FindModel(name);
  if (!model || !model->sources.empty() || !model->destinations.empty() ||
      !model->complete.empty() || !model->pending.empty() || model->pulling != 0 ||
      HasRemoteSources(*model)) {
    return;
  }
  Logger("store")->info("model={} forgotten: no buffers, versions or sources left", name);
  models_.erase(name);
  remotes_.Erase(name);
  budget_.Forget(name);
  changed_.NotifyAll();
}

absl::StatusOr<DropResult> Store::DropModel(const std::string& name) {
  common::MutexLock lock(mu_);
  Model* model = FindModel(name);
  if (!model) {
    std::vector<std::string> known;
    for (const auto& [n, m] : models_) known.push_back(n);
    return absl::NotFoundError(
        absl::StrCat("model ", name, " is not known to this node", KnownModelsHint(name, known)));
  }
  if (!model->sources.empty() || !model->destinations.empty()) {
    std::vector<std::string> held;
    for (const auto* ids : {&model->sources, &model->destinations}) {
      for (const std::string& id : *ids) {
        const Buffer& b = *buffers_.at(id);
        held.push_back(absl::StrCat(id, " (client ", b.client.empty() ? "unnamed" : b.client, ")"));
      }
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", name, " still has ", held.size(),
        " buffer(s) registered: ", absl::StrJoin(held, ", "),
        "; stop its trainers and engines (or `refitctl release` their buffers) first"));
  }
  seeded_holds_.erase(name);
  DropResult result;
  for (const auto& [v, version] : model->complete) result.released_versions.push_back(v);
  counters_.versions_dropped.Add(static_cast<double>(model->complete.size()));
  if (HasRemoteSources(*model)) {
    // Other nodes still have sources: keep what they told, forget every version. Their next
    // announcement (or the one they made) completes here again for an engine that registers.
    model->complete.clear();
    model->pending.clear();
    model->snapshots.clear();
    model->history.clear();
    model->plans.clear();
    model->latest = 0;
    model->local_ready = 0;
    model->failed = 0;
    model->failed_status = absl::OkStatus();
    model->skipped = 0;
    model->skipped_reason.clear();
    model->latest_runs.clear();
    model->hold = 0;
    model->events.clear();
  } else {
    models_.erase(name);
    remotes_.Erase(name);
    budget_.Forget(name);
  }
  Logger("store")->info("model={} dropped: {} version(s) released", name,
                        result.released_versions.size());
  changed_.NotifyAll();
  return result;
}

void Store::AddListener(StoreEvents* listener) {
  common::MutexLock lock(mu_);
  listeners_.push_back(listener);
}

void Store::Shutdown() {
  common::MutexLock lock(mu_);
  shutdown_ = true;
  changed_.NotifyAll();
  quant_queue_.Shutdown();
}

}  // namespace refit
