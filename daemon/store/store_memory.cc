// Store: what each model's version slots cost on this node. A model's share is the bytes of one
// version's slots here; it may hold at most (retain + 1) shares: the versions --retain keeps
// and the one being published or pulled (which becomes a held one: no second copy). Spare slots
// are kept only within that budget (SlotPool owners), and a version that cannot fit under
// --max-slot-memory is refused before anything is copied or pulled, with the numbers.

#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {

uint64_t Store::ShareOf(const Model& model, uint64_t more_source, bool destination) const {
  uint64_t share = more_source;
  for (const std::string& id : model.sources) {
    const Buffer& b = *buffers_.at(id);
    share += b.span_end - b.span_begin;
  }
  // Other nodes' pieces are staged here (whole, even when only some ranges are needed) when
  // this node has destinations for them, or were imported whole.
  const bool staged = destination || !model.destinations.empty();
  for (const auto& [node, remote] : model.remotes) {
    for (const SourceLayout& l : remote.sources) {
      if (staged || remote.imported.count(l.buffer_id)) share += l.bytes;
    }
  }
  return share;
}

void Store::UpdateBudget(Model& model) {
  model.share = ShareOf(model);
  const uint64_t budget = (uint64_t{options_.retain} + 1) * model.share;
  pool_->SetBudget(model.name, budget);
  if (gpu_pool_) gpu_pool_->SetBudget(model.name, budget);
}

absl::Status Store::CheckVersionFits(const Model& model, uint64_t share,
                                     const std::string& what) const {
  const uint64_t max = options_.max_slot_bytes;
  if (max == 0) return absl::OkStatus();
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  const uint64_t mine = pool_->UsageOf(model.name).in_use;
  const uint64_t others = in_use - std::min(in_use, mine);
  if (share <= max && others <= max - share) return absl::OkStatus();
  const uint64_t steady = (uint64_t{options_.retain} + 1) * share;
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", model.name, ": ", what, ": one version takes ", share,
      " bytes of version slots on this node, more than --max-slot-memory=", max, " leaves (",
      max - std::min(max, others), " bytes beside the ", others,
      " other models' versions use here); nothing was evicted. --retain=", options_.retain,
      " needs ", steady + others, " bytes ((", options_.retain, " + 1) x ", share, " + ", others,
      "): raise --max-slot-memory, or hold less of the model on this node"));
}

absl::Status Store::CheckPullFits(const Model& model, uint64_t version, uint64_t bytes) const {
  const uint64_t max = options_.max_slot_bytes;
  if (max == 0) return absl::OkStatus();
  // Spare slots make room; slots in use (held versions, other pulls) don't.
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  if (bytes <= max && in_use <= max - bytes) return absl::OkStatus();
  const uint64_t mine = pool_->UsageOf(model.name).in_use;
  return absl::ResourceExhaustedError(
      absl::StrCat("model ", model.name, ": version ", version, " not pulled: its staging takes ",
                   bytes, " bytes of version slots, and ", in_use, " of --max-slot-memory=", max,
                   " are in use on this node (", std::min(mine, in_use), " by this model's ",
                   model.complete.size(),
                   " held version(s), the rest by other models); nothing was "
                   "evicted. --retain=",
                   options_.retain, " needs (", options_.retain, " + 1) x ", model.share, " = ",
                   (uint64_t{options_.retain} + 1) * model.share,
                   " bytes for this model: raise --max-slot-memory or lower --retain"));
}

void Store::FillMemory(const Model& model, ModelInfo* info) const {
  std::set<const Region*> seen;
  uint64_t held = 0;
  auto count = [&](const std::shared_ptr<Region>& slot) {
    if (slot && slot->kind() == MemoryKind::kHost && seen.insert(slot.get()).second) {
      held += slot->size();
    }
  };
  for (const auto& [number, version] : model.complete) {
    for (const Piece& piece : version->pieces) {
      count(piece.slot);
      count(piece.host);
    }
  }
  for (const auto& [number, snapshot] : model.snapshots) {
    for (const LocalSnapshot::Piece& piece : snapshot->pieces) count(piece.slot);
  }
  const SlotPool::Usage usage = pool_->UsageOf(model.name);
  info->held_bytes = held;
  info->spare_bytes = usage.spare;
  info->in_flight_bytes = usage.in_use > held ? usage.in_use - held : 0;
  info->share_bytes = model.share;
  info->budget_bytes = (uint64_t{options_.retain} + 1) * model.share;

  const uint64_t max = options_.max_slot_bytes;
  if (max == 0 || model.share == 0) return;
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  const uint64_t others = in_use - std::min(in_use, usage.in_use);
  if (model.share > max || in_use > max - model.share) {
    info->memory_warning = absl::StrCat(
        "its next version would not fit: it takes ", model.share, " bytes of version slots and ",
        in_use, " of --max-slot-memory=", max, " are in use here (", usage.in_use,
        " by this model); the next Publish or pull of it will be refused");
  } else if (info->budget_bytes > max || others > max - info->budget_bytes) {
    info->memory_warning = absl::StrCat(
        "--retain=", options_.retain, " needs ", info->budget_bytes, " bytes ((", options_.retain,
        " + 1) x ", model.share, ") of version slots, and --max-slot-memory=", max, " leaves ",
        max - std::min(max, others), " beside other models' ", others,
        ": a version will be refused before ", options_.retain, " are held");
  }
}

absl::StatusOr<std::shared_ptr<Region>> Store::AcquireSlot(uint64_t size) {
  // The data plane stages a pull's pieces here: the slot belongs to the model being pulled
  // with a piece of that size (it becomes a held version's slot), so that it counts against
  // that model's budget and, released, is kept only within it.
  std::string owner;
  {
    common::MutexLock lock(mu_);
    for (const auto& [name, model] : models_) {
      if (model->pulling != 0 && model->pulling_sizes.count(size)) {
        owner = name;
        break;
      }
    }
  }
  return pool_->Acquire(size, owner);
}

std::vector<ModelInfo> Store::Models() const {
  common::MutexLock lock(mu_);
  std::vector<ModelInfo> out;
  for (const auto& [name, model] : models_) {
    ModelInfo info;
    info.name = name;
    info.latest_version = model->latest;
    for (const auto& [v, version] : model->complete) {
      info.versions.push_back(v);
      info.version_bytes = version->bytes;
      info.latest_nonfinite_values = version->quant->nonfinite();
    }
    if (model->failed > model->latest) {
      info.abandoned_version = model->failed;
      info.abandoned_error = model->failed_status.ToString();
    }
    info.skipped_version = model->skipped;
    info.skipped_reason = model->skipped_reason;
    info.source_buffers = static_cast<uint32_t>(model->sources.size());
    info.destination_buffers = static_cast<uint32_t>(model->destinations.size());
    for (const auto* ids : {&model->sources, &model->destinations}) {
      for (const std::string& id : *ids) {
        const Buffer& b = *buffers_.at(id);
        info.buffers.push_back(BufferInfo{b.id, b.role, b.client, b.region->size(),
                                          static_cast<uint32_t>(b.slices.size()), b.last_published,
                                          b.region->kind(), b.refused, b.applied.load()});
      }
    }
    FillMemory(*model, &info);
    info.delta_base = DeltaBaseName(DeltaBaseOf(name));
    if (model->destination_base && model->complete.count(model->destination_base->version)) {
      info.destination_base_version = model->destination_base->version;
    }
    info.delta_base_note = model->delta_base_note;
    info.run = model->run;
    info.past_runs.assign(model->past_runs.begin(), model->past_runs.end());
    info.rollback_version = model->hold;
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace refit
