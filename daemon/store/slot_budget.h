#pragma once

// The slot budget (issue 38: the store split along its seams): the slot pools version slots
// come from, and what each model's slots may cost on this node. A model's share is the bytes of
// one version's slots here; it may hold at most (retain + 1) shares: the versions --retain
// keeps and the one being published or pulled (which becomes a held one: no second copy). Spare
// slots are kept only within that budget (SlotPool owners), and a version that cannot fit under
// --max-slot-memory is refused before anything is copied or pulled, with the numbers.
//
// The store computes each model's share (it knows the buffers and the other nodes' layouts)
// and tells it here (SetShare); the data plane's staging slots come from here (AcquireStaging)
// without the store's lock.
//
// Lock order (docs/architecture.md, "The store's parts and their locks"): Store::mu_, then
// SlotBudget::mu_, then the pools' own locks. Calls nothing of the store.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/store_types.h"

namespace refit {

class SlotBudget {
 public:
  // The store's StoreOptions, passed on (refitd's values; their defaults are in DaemonOptions).
  struct Options {
    uint32_t retain = 0;  // --retain, >= 1 (0 aborts the constructor: never set)
    uint64_t max_spare_slot_bytes = 0;
    MemoryKind slot_memory = MemoryKind::kHost;
    int slot_device = 0;
    SlotPool::Allocator host_slot_allocator;  // null: pinned memory
    uint64_t max_slot_bytes = 0;              // host slots; 0: no limit
    uint64_t max_gpu_slot_bytes = 0;          // GPU slots; 0: no limit
  };

  SlotBudget(Options options, Metrics* metrics);
  SlotBudget(const SlotBudget&) = delete;
  SlotBudget& operator=(const SlotBudget&) = delete;

  // Host slots: local snapshots, staging, mirrors.
  const std::shared_ptr<SlotPool>& host() const { return pool_; }
  // GPU slots (--slot-memory=cuda); null otherwise.
  const std::shared_ptr<SlotPool>& gpu() const { return gpu_pool_; }

  // `model`'s share is `share` bytes now: its pools' budget is (retain + 1) x share.
  void SetShare(const std::string& model, uint64_t share);
  uint64_t ShareOf(const std::string& model) const;
  // `model` is forgotten: budget 0, no share, no staging.
  void Forget(const std::string& model);

  // A pull of `model` stages pieces of these sizes (one pull per model at a time): a staging
  // slot of one of them belongs to it. EndStaging: the pull ended.
  void SetStaging(const std::string& model, std::set<uint64_t> sizes);
  void EndStaging(const std::string& model);
  // A slot of `size` bytes for staging pulled bytes, counted against the model being pulled
  // with a piece of that size (the first by name), or no model's.
  absl::StatusOr<std::shared_ptr<Region>> AcquireStaging(uint64_t size);

  // RESOURCE_EXHAUSTED, with the numbers, when one version of `share` bytes of `model` cannot
  // fit under --max-slot-memory beside the other models' slots in use. `what` names the step.
  absl::Status CheckVersionFits(const std::string& model, uint64_t share,
                                const std::string& what) const;
  // RESOURCE_EXHAUSTED, with the numbers, when staging `bytes` for `version` of `model` (which
  // holds `held_versions` complete versions) would take the slots in use past
  // --max-slot-memory (checked before a pull starts).
  absl::Status CheckPullFits(const std::string& model, uint64_t version, uint64_t bytes,
                             size_t held_versions) const;
  // Fills the memory fields of `info` for `model`, which holds `held` bytes of host slots.
  void Fill(const std::string& model, uint64_t held, ModelInfo* info) const;

 private:
  const Options options_;
  std::shared_ptr<SlotPool> pool_;
  std::shared_ptr<SlotPool> gpu_pool_;
  mutable common::Mutex mu_;
  std::map<std::string, uint64_t> shares_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<uint64_t>> staging_ ABSL_GUARDED_BY(mu_);  // by model name
};

}  // namespace refit
