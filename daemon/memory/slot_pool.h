#pragma once

// A pool of daemon-owned version slots. Publishing a version every few seconds would otherwise
// map, fault in and unmap a model-sized slot each time; the pool hands back slots that a dropped
// version released, so a steady stream of versions runs at memcpy speed.
//
// Owners. A slot may belong to an owner (the store uses model names): the pool counts each
// owner's slots in use and spare, and keeps a released slot of an owner for reuse only while
// the owner's slots in use and spare stay within the owner's budget (SetBudget). Slots of no
// owner ("") are kept while all spare slots stay within `max_spare_bytes`, as before owners.
//
// Thread-safe. Slots handed out may outlive the pool (they are then simply freed).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/memory/region.h"

namespace refit {

class SlotPool : public std::enable_shared_from_this<SlotPool> {
 public:
  // Makes a new slot (AllocateHost by default; e.g. pinned or GPU memory).
  using Allocator = std::function<absl::StatusOr<std::unique_ptr<Region>>(uint64_t size)>;

  // Told the bytes the pool holds (in use + spare) whenever that changes.
  using Observer = std::function<void(uint64_t held_bytes)>;

  // Keeps at most `max_spare_bytes` of released slots for reuse. With `max_bytes` > 0 the pool
  // never holds more than that (slots in use and spare together): spare slots are freed to make
  // room, and past that Acquire is RESOURCE_EXHAUSTED.
  static std::shared_ptr<SlotPool> Create(uint64_t max_spare_bytes,
                                          Allocator allocate = AllocateHost, uint64_t max_bytes = 0,
                                          Observer observe = nullptr);

  // A slot of exactly `size` bytes for `owner`, reused when one is spare (the owner's own
  // first, then another's of that size). Its contents are unspecified.
  absl::StatusOr<std::shared_ptr<Region>> Acquire(uint64_t size, const std::string& owner = "");

  // Makes sure at least `count` spare slots of `size` bytes exist for `owner` (within the spare
  // limit, the owner's budget and `max_bytes`), so that the first versions of a newly
  // registered source don't pay for faulting memory in.
  absl::Status Reserve(uint64_t size, int count, const std::string& owner = "");

  // Hands a slot acquired from this pool (e.g. by the data plane, for no owner) to `owner`.
  void Adopt(const Region* slot, const std::string& owner);

  // The most bytes `owner`'s slots, in use and spare, should take: spare slots of the owner
  // past it are freed now and no more are kept. 0 (the default): the owner keeps no spare.
  void SetBudget(const std::string& owner, uint64_t bytes);

  struct Usage {
    uint64_t in_use = 0;  // slots handed out and not yet released
    uint64_t spare = 0;   // released slots kept for reuse
    uint64_t budget = 0;  // SetBudget
  };
  Usage UsageOf(const std::string& owner) const;

  uint64_t spare_bytes() const;
  uint64_t held_bytes() const;  // slots in use and spare
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  struct Spare {
    std::unique_ptr<Region> region;
    std::string owner;
  };
  SlotPool(uint64_t max_spare_bytes, Allocator allocate, uint64_t max_bytes, Observer observe)
      : max_spare_bytes_(max_spare_bytes),
        allocate_(std::move(allocate)),
        max_bytes_(max_bytes),
        observe_(std::move(observe)) {}
  // Allocates a slot counted against max_bytes_, freeing spare slots to make room (other
  // owners' first).
  absl::StatusOr<std::unique_ptr<Region>> Allocate(uint64_t size, const std::string& owner);
  std::shared_ptr<Region> HandOut(std::unique_ptr<Region> region, const std::string& owner);
  void Release(std::unique_ptr<Region> region);
  // Whether a released slot of `size` of `owner` is kept (`owner`'s in_use already less the
  // slot).
  bool KeepSpare(uint64_t size, const std::string& owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Observe() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t max_spare_bytes_;
  const Allocator allocate_;
  const uint64_t max_bytes_;
  const Observer observe_;
  mutable common::Mutex mu_;
  std::multimap<uint64_t, Spare> spare_ ABSL_GUARDED_BY(mu_);  // by size
  uint64_t spare_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Slots handed out.
  std::unordered_map<const Region*, std::string> owner_of_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);  // by owner ("" included)
};

}  // namespace refit
