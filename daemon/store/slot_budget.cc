#include "daemon/store/slot_budget.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/store/store_metrics.h"

namespace refit {

SlotBudget::SlotBudget(Options options, Metrics* metrics)
    : options_(std::move(options)),
      pool_(SlotPool::Create(
          options_.max_spare_slot_bytes,
          options_.host_slot_allocator ? options_.host_slot_allocator : cuda::AllocatePinnedHost,
          options_.max_slot_bytes,
          [slot_memory = metrics->Declare(kSlotMemoryBytes)](uint64_t held) {
            slot_memory.Set(static_cast<double>(held));
          })) {
  if (options_.retain < 1) {
    Logger("store")->critical("SlotBudget: retain is 0: set it from --retain (>= 1)");
    std::abort();
  }
  metrics->Declare(kSlotMemoryLimitBytes);
  metrics->Set(kSlotMemoryBytes, 0);
  metrics->Set(kSlotMemoryLimitBytes, static_cast<double>(options_.max_slot_bytes));
  if (options_.slot_memory == MemoryKind::kCuda) {
    const int device = options_.slot_device;
    gpu_pool_ = SlotPool::Create(
        options_.max_spare_slot_bytes,
        [device](uint64_t size) { return cuda::AllocateDevice(size, device); },
        options_.max_gpu_slot_bytes);
  }
}

void SlotBudget::SetShare(const std::string& model, uint64_t share) {
  {
    common::MutexLock lock(mu_);
    shares_[model] = share;
  }
  const uint64_t budget = (uint64_t{options_.retain} + 1) * share;
  pool_->SetBudget(model, budget);
  if (gpu_pool_) gpu_pool_->SetBudget(model, budget);
}

uint64_t SlotBudget::ShareOf(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = shares_.find(model);
  return it == shares_.end() ? 0 : it->second;
}

void SlotBudget::Forget(const std::string& model) {
  {
    common::MutexLock lock(mu_);
    shares_.erase(model);
    staging_.erase(model);
  }
  pool_->SetBudget(model, 0);
  if (gpu_pool_) gpu_pool_->SetBudget(model, 0);
}

void SlotBudget::SetStaging(const std::string& model, std::set<uint64_t> sizes) {
  common::MutexLock lock(mu_);
  staging_[model] = std::move(sizes);
}

void SlotBudget::EndStaging(const std::string& model) {
  common::MutexLock lock(mu_);
  staging_.erase(model);
}

absl::StatusOr<std::shared_ptr<Region>> SlotBudget::AcquireStaging(uint64_t size) {
  // The data plane stages a pull's pieces here: the slot belongs to the model being pulled
  // with a piece of that size (it becomes a held version's slot), so that it counts against
  // that model's budget and, released, is kept only within it.
  std::string owner;
  {
    common::MutexLock lock(mu_);
    for (const auto& [name, sizes] : staging_) {
      if (sizes.count(size)) {
        owner = name;
        break;
      }
    }
  }
  return pool_->Acquire(size, owner);
}

absl::Status SlotBudget::CheckVersionFits(const std::string& model, uint64_t share,
                                          const std::string& what) const {
  const uint64_t max = options_.max_slot_bytes;
  if (max == 0) return absl::OkStatus();
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  const uint64_t mine = pool_->UsageOf(model).in_use;
  const uint64_t others = in_use - std::min(in_use, mine);
  if (share <= max && others <= max - share) return absl::OkStatus();
  const uint64_t steady = (uint64_t{options_.retain} + 1) * share;
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", model, ": ", what, ": one version takes ", share,
      " bytes of version slots on this node, more than --max-slot-memory=", max, " leaves (",
      max - std::min(max, others), " bytes beside the ", others,
      " other models' versions use here); nothing was evicted. --retain=", options_.retain,
      " needs ", steady + others, " bytes ((", options_.retain, " + 1) x ", share, " + ", others,
      "): raise --max-slot-memory, or hold less of the model on this node"));
}

absl::Status SlotBudget::CheckPullFits(const std::string& model, uint64_t version, uint64_t bytes,
                                       size_t held_versions) const {
  const uint64_t max = options_.max_slot_bytes;
  if (max == 0) return absl::OkStatus();
  // Spare slots make room; slots in use (held versions, other pulls) don't.
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  if (bytes <= max && in_use <= max - bytes) return absl::OkStatus();
  const uint64_t mine = pool_->UsageOf(model).in_use;
  const uint64_t share = ShareOf(model);
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", model, ": version ", version, " not pulled: its staging takes ", bytes,
      " bytes of version slots, and ", in_use, " of --max-slot-memory=", max,
      " are in use on this node (", std::min(mine, in_use), " by this model's ", held_versions,
      " held version(s), the rest by other models); nothing was "
      "evicted. --retain=",
      options_.retain, " needs (", options_.retain, " + 1) x ", share, " = ",
      (uint64_t{options_.retain} + 1) * share,
      " bytes for this model: raise --max-slot-memory or lower --retain"));
}

void SlotBudget::Fill(const std::string& model, uint64_t held, ModelInfo* info) const {
  const uint64_t share = ShareOf(model);
  const SlotPool::Usage usage = pool_->UsageOf(model);
  info->held_bytes = held;
  info->spare_bytes = usage.spare;
  info->in_flight_bytes = usage.in_use > held ? usage.in_use - held : 0;
  info->share_bytes = share;
  info->budget_bytes = (uint64_t{options_.retain} + 1) * share;

  const uint64_t max = options_.max_slot_bytes;
  if (max == 0 || share == 0) return;
  const uint64_t in_use = pool_->held_bytes() - pool_->spare_bytes();
  const uint64_t others = in_use - std::min(in_use, usage.in_use);
  if (share > max || in_use > max - share) {
    info->memory_warning = absl::StrCat(
        "its next version would not fit: it takes ", share, " bytes of version slots and ", in_use,
        " of --max-slot-memory=", max, " are in use here (", usage.in_use,
        " by this model); the next Publish or pull of it will be refused");
  } else if (info->budget_bytes > max || others > max - info->budget_bytes) {
    info->memory_warning = absl::StrCat(
        "--retain=", options_.retain, " needs ", info->budget_bytes, " bytes ((", options_.retain,
        " + 1) x ", share, ") of version slots, and --max-slot-memory=", max, " leaves ",
        max - std::min(max, others), " beside other models' ", others,
        ": a version will be refused before ", options_.retain, " are held");
  }
}

}  // namespace refit
