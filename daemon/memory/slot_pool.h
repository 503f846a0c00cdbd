#pragma once

// A pool of daemon-owned version slots. Publishing a version every few seconds would otherwise
// map, fault in and unmap a model-sized slot each time; the pool hands back slots that a dropped
// version released, so a steady stream of versions runs at memcpy speed.
//
// Thread-safe. Slots handed out may outlive the pool (they are then simply freed).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
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
                                          Allocator allocate = AllocateHost,
                                          uint64_t max_bytes = 0, Observer observe = nullptr);

  // A slot of exactly `size` bytes, reused when one is spare. Its contents are unspecified.
  absl::StatusOr<std::shared_ptr<Region>> Acquire(uint64_t size);

  // Makes sure at least `count` spare slots of `size` bytes exist (within the spare limit and
  // `max_bytes`), so that the first versions of a newly registered source don't pay for
  // faulting memory in.
  absl::Status Reserve(uint64_t size, int count);

  uint64_t spare_bytes() const;
  uint64_t held_bytes() const;  // slots in use and spare

 private:
  SlotPool(uint64_t max_spare_bytes, Allocator allocate, uint64_t max_bytes, Observer observe)
      : max_spare_bytes_(max_spare_bytes),
        allocate_(std::move(allocate)),
        max_bytes_(max_bytes),
        observe_(std::move(observe)) {}
  // Allocates a slot counted against max_bytes_, freeing spare slots to make room.
  absl::StatusOr<std::unique_ptr<Region>> Allocate(uint64_t size);
  void Release(std::unique_ptr<Region> region);
  void Observe() const;  // mu_ held

  const uint64_t max_spare_bytes_;
  const Allocator allocate_;
  const uint64_t max_bytes_;
  const Observer observe_;
  mutable std::mutex mu_;
  std::multimap<uint64_t, std::unique_ptr<Region>> spare_;  // by size
  uint64_t spare_bytes_ = 0;
  uint64_t held_bytes_ = 0;
};

}  // namespace refit
