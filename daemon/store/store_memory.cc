// Store: what each model's version slots cost on this node: the share (one version's slots
// here) computed from the model's buffers and other nodes' layouts, handed to the slot budget
// (slot_budget.h), which holds the pools and the budgets and refuses what cannot fit; and
// Models(), the store's report (ModelInfo).

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
  for (const auto& [node, remote] : remotes_.Of(model.name)) {
    for (const SourceLayout& l : remote.sources) {
      if (staged || remote.imported.count(l.buffer_id)) share += l.bytes;
    }
  }
  return share;
}

void Store::UpdateBudget(Model& model) { budget_.SetShare(model.name, ShareOf(model)); }

absl::Status Store::CheckVersionFits(const Model& model, uint64_t share,
                                     const std::string& what) const {
  return budget_.CheckVersionFits(model.name, share, what);
}

absl::Status Store::CheckPullFits(const Model& model, uint64_t version, uint64_t bytes) const {
  return budget_.CheckPullFits(model.name, version, bytes, model.complete.size());
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
  budget_.Fill(model.name, held, info);
}

absl::StatusOr<std::shared_ptr<Region>> Store::AcquireSlot(uint64_t size) {
  return budget_.AcquireStaging(size);  // the slot budget's lock only, not the store's
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
