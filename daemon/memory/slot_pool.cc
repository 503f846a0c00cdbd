#include "daemon/memory/slot_pool.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace refit {

std::shared_ptr<SlotPool> SlotPool::Create(uint64_t max_spare_bytes, Allocator allocate,
                                           uint64_t max_bytes, Observer observe) {
  return std::shared_ptr<SlotPool>(
      new SlotPool(max_spare_bytes, std::move(allocate), max_bytes, std::move(observe)));
}

absl::StatusOr<std::shared_ptr<Region>> SlotPool::Acquire(uint64_t size) {
  std::unique_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find(size);
    if (it != spare_.end()) {
      region = std::move(it->second);
      spare_.erase(it);
      spare_bytes_ -= size;
    }
  }
  if (!region) {
    auto allocated = Allocate(size);
    if (!allocated.ok()) return allocated.status();
    region = std::move(allocated).value();
  }
  std::weak_ptr<SlotPool> weak = weak_from_this();
  Region* raw = region.release();
  return std::shared_ptr<Region>(raw, [weak](Region* r) {
    std::unique_ptr<Region> owned(r);
    if (auto pool = weak.lock()) pool->Release(std::move(owned));
  });
}

absl::StatusOr<std::unique_ptr<Region>> SlotPool::Allocate(uint64_t size) {
  std::vector<std::unique_ptr<Region>> evicted;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (max_bytes_ > 0) {
      // Spare slots can make room; slots in use can't. Refused before anything is freed, and
      // compared without sums that could wrap (a size may come from a peer's announcement).
      const uint64_t in_use = held_bytes_ - spare_bytes_;
      if (size > max_bytes_ || in_use > max_bytes_ - size) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "a ", size, "-byte slot would take this daemon's version slots past its limit of ",
            max_bytes_, " bytes (", in_use,
            " in use; --max-slot-memory: every version held, being published or pulled takes "
            "one; lower --retain or raise the limit)"));
      }
      // Spare slots of other sizes go (largest first) until it fits.
      while (held_bytes_ > max_bytes_ - size) {
        auto it = std::prev(spare_.end());
        spare_bytes_ -= it->first;
        held_bytes_ -= it->first;
        evicted.push_back(std::move(it->second));
        spare_.erase(it);
      }
    }
    held_bytes_ += size;  // counted now, so that concurrent calls can't both pass the limit
    Observe();
  }
  evicted.clear();
  auto allocated = allocate_(size);
  if (!allocated.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    held_bytes_ -= size;
    Observe();
  }
  return allocated;
}

void SlotPool::Release(std::unique_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t size = region->size();
  if (size > max_spare_bytes_ || spare_bytes_ > max_spare_bytes_ - size) {
    held_bytes_ -= size;
    Observe();
    return;  // freed on return
  }
  spare_bytes_ += size;
  spare_.emplace(size, std::move(region));
}

absl::Status SlotPool::Reserve(uint64_t size, int count) {
  int have = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    have = static_cast<int>(spare_.count(size));
  }
  for (; have < count; ++have) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (size > max_spare_bytes_ || spare_bytes_ > max_spare_bytes_ - size) break;
      // Within the limit without freeing anything.
      if (max_bytes_ > 0 && (size > max_bytes_ || held_bytes_ > max_bytes_ - size)) break;
    }
    auto region = Allocate(size);
    if (!region.ok()) return region.status();
    Release(std::move(region).value());
  }
  return absl::OkStatus();
}

uint64_t SlotPool::spare_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_bytes_;
}

uint64_t SlotPool::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_bytes_;
}

void SlotPool::Observe() const {
  if (observe_) observe_(held_bytes_);
}

}  // namespace refit
