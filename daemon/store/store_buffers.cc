// Store: registering and releasing buffers (a second registration of the same memory is
// idempotent for its caller, refused for anyone else).

#include <sys/random.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/names.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/plan.h"
#include "daemon/plan/scales.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

bool SameSlice(const TensorSlice& a, const TensorSlice& b) {
  return a.name == b.name && a.dtype == b.dtype && a.global_shape == b.global_shape &&
         a.offsets == b.offsets && a.sizes == b.sizes && a.buffer_offset == b.buffer_offset &&
         a.buffer_strides == b.buffer_strides && a.scale_tensor == b.scale_tensor &&
         a.scale_block == b.scale_block;
}

bool SameSlices(const std::vector<TensorSlice>& a, const std::vector<TensorSlice>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameSlice(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace

absl::Status Store::SameRegistration(const Buffer& existing, const Buffer& again) {
  std::string differs;
  if (existing.owner != again.owner) {
    differs = "by another process";
  } else if (existing.model != again.model) {
    differs = absl::StrCat("for model ", existing.model, ", not ", again.model);
  } else if (existing.role != again.role) {
    differs = absl::StrCat("as ", RoleName(existing.role), ", not ", RoleName(again.role));
  } else if (!SameSlices(existing.slices, again.slices)) {
    differs = "with another tensor layout";
  } else {
    return absl::OkStatus();
  }
  return absl::AlreadyExistsError(absl::StrCat(
      "this memory (", again.region->Describe(), ") is already registered as buffer ", existing.id,
      existing.client.empty() ? "" : absl::StrCat(" (client ", existing.client, ")"), ", ", differs,
      "; nothing changed: release that buffer first to register it otherwise"));
}

absl::StatusOr<std::string> Store::RegisterBuffer(const std::string& model_name, Role role,
                                                  std::unique_ptr<Region> region,
                                                  std::vector<TensorSlice> slices,
                                                  const std::string& client,
                                                  const std::string& owner) {
  if (model_name.empty()) return absl::InvalidArgumentError("model name is empty");
  if (role != Role::kSource && role != Role::kDestination) {
    return absl::InvalidArgumentError("role must be SOURCE or DESTINATION");
  }
  if (!region) return absl::InvalidArgumentError("no memory region");
  if (slices.empty()) return absl::InvalidArgumentError("a buffer needs at least one tensor");
  // One pass: the slices normalized and checked, scaled slices too (DESTINATION only).
  bool scaled = false;
  RETURN_IF_ERROR(plan::NormalizeAndValidateScaledBuffer(slices, region->size(),
                                                         role == Role::kDestination, &scaled));

  auto buffer = std::make_shared<Buffer>();
  buffer->scaled = scaled;
  buffer->model = model_name;
  buffer->client = client;
  buffer->role = role;
  buffer->region = std::move(region);
  buffer->slices = std::move(slices);
  if (role == Role::kSource) {
    buffer->span_begin = UINT64_MAX;
    for (const TensorSlice& s : buffer->slices) {
      auto [begin, end] = plan::SliceByteExtent(s);
      buffer->span_begin = std::min(buffer->span_begin, begin);
      buffer->span_end = std::max(buffer->span_end, end);
    }
    auto relative = std::make_shared<std::vector<TensorSlice>>(buffer->slices);
    for (TensorSlice& s : *relative) s.buffer_offset -= buffer->span_begin;
    buffer->snapshot_slices = std::move(relative);
  }

  buffer->owner = owner;
  buffer->memory = buffer->region->Identity();

  common::UniqueLock lock(mu_);
  auto& model = models_[model_name];
  // A refused registration changes nothing: the model is dropped again only when this call
  // made it (a model known before keeps everything, other nodes' sources included).
  const bool created = !model;
  if (created) {
    model = std::make_unique<Model>();
    model->name = model_name;
    SeedHold(*model);
  }
  absl::Status consistent = CheckAgainstModel(*model, role, buffer->slices);
  if (consistent.ok() && !buffer->memory.empty()) {
    // The same memory again: the same caller gets its buffer back; anyone else is refused.
    auto known = by_memory_.find(buffer->memory);
    if (known != by_memory_.end()) {
      consistent = SameRegistration(*buffers_.at(known->second), *buffer);
      if (consistent.ok()) return known->second;
    }
  }
  if (consistent.ok()) {
    const bool first_destination = role == Role::kDestination && model->destinations.empty();
    const uint64_t share = role == Role::kSource
                               ? ShareOf(*model, buffer->span_end - buffer->span_begin)
                               : ShareOf(*model, 0, true);
    if (role == Role::kSource || first_destination) {
      consistent = CheckVersionFits(*model, share, "RegisterBuffer refused");
    }
  }
  if (!consistent.ok()) {
    if (created) {
      models_.erase(model_name);
      remotes_.Erase(model_name);
    }
    return consistent;
  }
  // A random part makes ids unguessable: another local caller can't name a buffer it wasn't
  // told about (ownership is checked too, in daemon/server).
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) nonce = std::random_device{}();
  buffer->id =
      absl::StrCat(options_.node, "/", model_name, "/", role == Role::kSource ? "src" : "dst", "-",
                   next_buffer_++, "-", absl::Hex(nonce, absl::kZeroPad16));
  (role == Role::kSource ? model->sources : model->destinations).insert(buffer->id);
  // The model's tensors by name take the new slices in (tensor_index.h): no map of the whole
  // model is built again for the next registration.
  if (role == Role::kSource) {
    if (model->source_index.valid()) {
      model->source_index.AddLocal(buffer->id, buffer->client, buffer->slices);
    }
  } else {
    model->destination_index.Add(buffer->slices);
    if (scaled) ++model->scaled_buffers;
  }
  model->plans.clear();
  buffers_[buffer->id] = buffer;
  if (!buffer->memory.empty()) by_memory_[buffer->memory] = buffer->id;
  UpdateBudget(*model);
  if (role == Role::kSource) {
    RecheckDestinations(*model);  // the sources win over destinations that came first
    for (StoreEvents* listener : listeners_) listener->OnLayoutChanged(model_name);
  }

  Logger("store")->info("model={} buffer={} registered: {} {} tensors, {} client={}", model_name,
                        buffer->id, RoleName(role), buffer->slices.size(),
                        buffer->region->Describe(), client);
  if (role == Role::kDestination && HasRemoteSources(*model)) {
    TryComplete(*model);  // an engine that just arrived wants the newest announced version
  }
  const std::string id = buffer->id;
  lock.unlock();
  if (role == Role::kDestination && buffer->region->kind() == MemoryKind::kHost) {
    // A refitd killed inside an Apply into this memory left its undo record: the bytes go back
    // before this call is answered, so no call on the model sees the mix (apply_journal.h).
    common::MutexLock io(buffer->io_mu);
    if (auto held =
            journal_->Recover(buffer->memory, buffer->region->data(), buffer->region->size())) {
      buffer->applied = *held;
    }
  }
  if (role == Role::kDestination) ReserveStaging(model_name);
  if (role == Role::kSource) {
    // Warm the slot pool for the versions to come (retain + the one being published): a
    // failure here only means the first publishes fault their memory in.
    (void)budget_.host()->Reserve(buffer->span_end - buffer->span_begin,
                                  static_cast<int>(options_.retain) + 1, model_name);
  }
  return id;
}

absl::Status Store::ReleaseBuffer(const std::string& buffer_id, const std::string& why) {
  common::MutexLock lock(mu_);
  auto it = buffers_.find(buffer_id);
  if (it == buffers_.end()) {
    return absl::NotFoundError(absl::StrCat("buffer ", buffer_id, " does not exist"));
  }
  std::shared_ptr<Buffer> buffer = it->second;
  buffers_.erase(it);
  if (!buffer->memory.empty()) by_memory_.erase(buffer->memory);
  Model& model = *FindModel(buffer->model);
  // Its slices leave the model's tensors by name: the index is built again when next needed.
  if (model.sources.erase(buffer_id)) model.source_index.Invalidate();
  // A destination that stood in for a released version no longer can; let go of its memory.
  if (model.destinations.erase(buffer_id)) {
    model.destination_base.reset();
    model.destination_index.Clear();
    if (buffer->scaled) --model.scaled_buffers;
  }
  model.plans.clear();
  UpdateBudget(model);
  Logger("store")->info("model={} buffer={} client={} released{}{}", buffer->model, buffer_id,
                        buffer->client, why.empty() ? "" : ": ", why);
  if (buffer->role == Role::kSource) {
    AbandonUnpublished(model, *buffer, why);
    // A pending version may now have every remaining source published.
    RecheckDestinations(model);
    for (StoreEvents* listener : listeners_) listener->OnLayoutChanged(buffer->model);
    TryComplete(model);
  }
  EraseIfEmpty(buffer->model);  // e.g. a misspelled model whose engine went away
  return absl::OkStatus();
}

void Store::AbandonUnpublished(Model& model, const Buffer& buffer, const std::string& why) {
  for (auto it = model.pending.begin(); it != model.pending.end();) {
    const uint64_t version = it->first;
    if (version <= buffer.last_published || it->second.count(buffer.id) > 0) {
      ++it;
      continue;
    }
    const std::string message = absl::StrCat(
        "model ", model.name, ": version ", version, " was abandoned: SOURCE buffer ", buffer.id,
        buffer.client.empty() ? "" : absl::StrCat(" (client ", buffer.client, ")"),
        " was released before it published that version",
        why.empty() ? "" : absl::StrCat(" (", why, ")"),
        "; the next version its successor publishes completes");
    Logger("store")->warn("{}", message);
    if (version > model.failed) {
      model.failed = version;
      model.failed_status = absl::FailedPreconditionError(message);
    }
    counters_.versions_abandoned.Add(1);
    it = model.pending.erase(it);
  }
}

}  // namespace refit
