#pragma once

// The checksum hints of one SOURCE buffer: the ranges off the Publish-time checksum grid that
// peers asked checksums for (Store::NoteChecksumRanges), so that the next Publishes hash them
// too, while each block is in cache. An object of its own (issue 38: the store split along its
// seams), with its own lock: a peer's Checksum request and a Publish of the same buffer meet
// only here, never under the store's lock.
//
// Lock order (docs/architecture.md, "The store's parts and their locks"): Store::mu_ is never
// held while this lock is taken; Buffer::io_mu may be (Publish hashes under it). Calls nothing.

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/memory/checksum.h"

namespace refit {

class ChecksumHints {
 public:
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

  // At most this many ranges are kept per buffer.
  static constexpr size_t kMaxRanges = 1u << 19;
  // A range no peer asked about during this many Publishes of its buffer is no longer hashed.
  static constexpr uint64_t kPublishes = 4;

  // A peer asked for the checksums of `runs` of the buffer, whose piece is `piece_bytes` long.
  // Runs are kept by offset (a later one replaces an earlier one there, unless it is only that
  // run's first ranges, as a reader asking again about chunks that failed would send). At most
  // kMaxRanges ranges, of at most kCopyBlockBytes each, and twice `piece_bytes` in all.
  void Note(uint64_t piece_bytes, const std::vector<RangeRun>& runs);

  // For a Publish of the buffer (`size` bytes): the ranges kept, sorted, less those not asked
  // about during the last kPublishes Publishes or past `size`. Counts the Publish.
  std::shared_ptr<const Ranges> ForPublish(uint64_t size);

 private:
  common::Mutex mu_;
  uint64_t publishes_ ABSL_GUARDED_BY(mu_) = 0;  // of the buffer so far
  uint64_t ranges_ ABSL_GUARDED_BY(mu_) = 0;     // in `runs_`
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;      // in `runs_`
  // By offset: (the run, `publishes_` when last asked about).
  std::unordered_map<uint64_t, std::pair<RangeRun, uint64_t>> runs_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Ranges> sorted_ ABSL_GUARDED_BY(mu_);  // null: rebuild
};

}  // namespace refit
