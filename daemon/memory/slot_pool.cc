#include "daemon/memory/slot_pool.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace refit {

std::shared_ptr<SlotPool> SlotPool::Create(uint64_t max_spare_bytes, Allocator allocate,
                                           uint64_t max_bytes, Observer observe) {
  return std::shared_ptr<SlotPool>(
      new SlotPool(max_spare_bytes, std::move(allocate), max_bytes, std::move(observe)));
}

absl::StatusOr<std::shared_ptr<Region>> SlotPool::Acquire(uint64_t size, const std::string& owner) {
  std::unique_ptr<Region> region;
  {
    common::MutexLock lock(mu_);
    auto [first, last] = spare_.equal_range(size);
    auto it = last;
    for (auto s = first; s != last; ++s) {
      if (s->second.owner == owner) {
        it = s;
        break;
      }
    }
    if (it == last) it = first;  // another owner's slot of that size
    if (it != last) {
      region = std::move(it->second.region);
      spare_bytes_ -= size;
      usage_[it->second.owner].spare -= size;
      spare_.erase(it);
    }
  }
  if (!region) {
    auto allocated = Allocate(size, owner);
    if (!allocated.ok()) return allocated.status();
    region = std::move(allocated).value();
  }
  return HandOut(std::move(region), owner);
}

std::shared_ptr<Region> SlotPool::HandOut(std::unique_ptr<Region> region,
                                          const std::string& owner) {
  {
    common::MutexLock lock(mu_);
    owner_of_[region.get()] = owner;
    usage_[owner].in_use += region->size();
  }
  std::weak_ptr<SlotPool> weak = weak_from_this();
  Region* raw = region.release();
  return std::shared_ptr<Region>(raw, [weak](Region* r) {
    std::unique_ptr<Region> owned(r);
    if (auto pool = weak.lock()) pool->Release(std::move(owned));
  });
}

absl::StatusOr<std::unique_ptr<Region>> SlotPool::Allocate(uint64_t size,
                                                           const std::string& owner) {
  std::vector<std::unique_ptr<Region>> evicted;  // freed outside the lock
  {
    common::MutexLock lock(mu_);
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
      // Spare slots go until it fits: other owners' first, largest first.
      while (held_bytes_ > max_bytes_ - size) {
        auto it = std::prev(spare_.end());
        for (auto s = spare_.rbegin(); s != spare_.rend(); ++s) {
          if (s->second.owner != owner) {
            it = std::prev(s.base());
            break;
          }
        }
        spare_bytes_ -= it->first;
        held_bytes_ -= it->first;
        usage_[it->second.owner].spare -= it->first;
        evicted.push_back(std::move(it->second.region));
        spare_.erase(it);
      }
    }
    held_bytes_ += size;  // counted now, so that concurrent calls can't both pass the limit
    Observe();
  }
  evicted.clear();
  auto allocated = allocate_(size);
  if (!allocated.ok()) {
    common::MutexLock lock(mu_);
    held_bytes_ -= size;
    Observe();
  }
  return allocated;
}

bool SlotPool::KeepSpare(uint64_t size, const std::string& owner) const {
  auto it = usage_.find(owner);
  const Usage usage = it == usage_.end() ? Usage() : it->second;
  if (owner.empty()) {
    return size <= max_spare_bytes_ && usage.spare <= max_spare_bytes_ - size;
  }
  return usage.budget >= size && usage.in_use + usage.spare <= usage.budget - size;
}

void SlotPool::Release(std::unique_ptr<Region> region) {
  common::MutexLock lock(mu_);
  const uint64_t size = region->size();
  std::string owner;
  if (auto it = owner_of_.find(region.get()); it != owner_of_.end()) {
    owner = std::move(it->second);
    owner_of_.erase(it);
  }
  usage_[owner].in_use -= size;
  if (!KeepSpare(size, owner)) {
    held_bytes_ -= size;
    Observe();
    return;  // freed on return, after the lock
  }
  spare_bytes_ += size;
  usage_[owner].spare += size;
  spare_.emplace(size, Spare{std::move(region), std::move(owner)});
}

absl::Status SlotPool::Reserve(uint64_t size, int count, const std::string& owner) {
  int have = 0;
  {
    common::MutexLock lock(mu_);
    auto [first, last] = spare_.equal_range(size);
    for (auto s = first; s != last; ++s) have += s->second.owner == owner ? 1 : 0;
  }
  for (; have < count; ++have) {
    {
      common::MutexLock lock(mu_);
      if (!KeepSpare(size, owner)) break;
      // Within the limit without freeing anything.
      if (max_bytes_ > 0 && (size > max_bytes_ || held_bytes_ > max_bytes_ - size)) break;
    }
    auto region = Allocate(size, owner);
    if (!region.ok()) return region.status();
    common::MutexLock lock(mu_);
    spare_bytes_ += size;
    usage_[owner].spare += size;
    spare_.emplace(size, Spare{std::move(region).value(), owner});
  }
  return absl::OkStatus();
}

void SlotPool::Adopt(const Region* slot, const std::string& owner) {
  common::MutexLock lock(mu_);
  auto it = owner_of_.find(slot);
  if (it == owner_of_.end() || it->second == owner) return;
  usage_[it->second].in_use -= slot->size();
  usage_[owner].in_use += slot->size();
  it->second = owner;
}

void SlotPool::SetBudget(const std::string& owner, uint64_t bytes) {
  std::vector<std::unique_ptr<Region>> evicted;  // freed outside the lock
  common::MutexLock lock(mu_);
  Usage& usage = usage_[owner];
  usage.budget = bytes;
  if (owner.empty()) return;
  for (auto it = spare_.end(); it != spare_.begin() && usage.in_use + usage.spare > bytes;) {
    --it;
    if (it->second.owner != owner) continue;
    spare_bytes_ -= it->first;
    held_bytes_ -= it->first;
    usage.spare -= it->first;
    evicted.push_back(std::move(it->second.region));
    it = spare_.erase(it);
  }
  if (!evicted.empty()) Observe();
  if (usage.in_use == 0 && usage.spare == 0 && usage.budget == 0) usage_.erase(owner);
}

SlotPool::Usage SlotPool::UsageOf(const std::string& owner) const {
  common::MutexLock lock(mu_);
  auto it = usage_.find(owner);
  return it == usage_.end() ? Usage() : it->second;
}

uint64_t SlotPool::spare_bytes() const {
  common::MutexLock lock(mu_);
  return spare_bytes_;
}

uint64_t SlotPool::held_bytes() const {
  common::MutexLock lock(mu_);
  return held_bytes_;
}

void SlotPool::Observe() const {
  if (observe_) observe_(held_bytes_);
}

}  // namespace refit
