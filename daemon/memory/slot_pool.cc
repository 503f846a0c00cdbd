#include "daemon/memory/slot_pool.h"

namespace refit {

std::shared_ptr<SlotPool> SlotPool::Create(uint64_t max_spare_bytes, Allocator allocate) {
  return std::shared_ptr<SlotPool>(new SlotPool(max_spare_bytes, std::move(allocate)));
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
    auto allocated = allocate_(size);
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

void SlotPool::Release(std::unique_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t size = region->size();
  if (spare_bytes_ + size > max_spare_bytes_) return;  // freed on return
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
      if (spare_bytes_ + size > max_spare_bytes_) break;
    }
    auto region = allocate_(size);
    if (!region.ok()) return region.status();
    Release(std::move(region).value());
  }
  return absl::OkStatus();
}

uint64_t SlotPool::spare_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_bytes_;
}

}  // namespace refit
