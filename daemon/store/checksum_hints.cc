#include "daemon/store/checksum_hints.h"

#include <algorithm>

namespace refit {

void ChecksumHints::Note(uint64_t piece_bytes, const std::vector<RangeRun>& runs) {
  common::MutexLock lock(mu_);
  const uint64_t max_bytes = 2 * piece_bytes;
  for (const RangeRun& run : runs) {
    if (run.count == 0 || run.length == 0 || run.length > kCopyBlockBytes) continue;
    auto it = runs_.find(run.offset);
    if (it != runs_.end()) {
      const RangeRun& had = it->second.first;
      // The same run, or its first ranges (a reader asking again about a few chunks that
      // failed their checksum): keep the run.
      const bool same_grid =
          had.length == run.length && (run.count == 1 || had.stride == run.stride);
      if (same_grid && run.count <= had.count) {
        it->second.second = publishes_;  // asked again
        continue;
      }
      ranges_ -= had.count;
      bytes_ -= had.count * had.length;
      runs_.erase(it);
      sorted_.reset();
    }
    // Callers pass validated runs (count * length <= the piece's size); no overflow below.
    const uint64_t bytes = run.count * run.length;
    if (run.count > kMaxRanges - std::min<uint64_t>(ranges_, kMaxRanges) ||
        bytes > max_bytes - std::min(bytes_, max_bytes)) {
      continue;
    }
    runs_.emplace(run.offset, std::make_pair(run, publishes_));
    ranges_ += run.count;
    bytes_ += bytes;
    sorted_.reset();
  }
}

std::shared_ptr<const ChecksumHints::Ranges> ChecksumHints::ForPublish(uint64_t size) {
  common::MutexLock lock(mu_);
  ++publishes_;
  for (auto it = runs_.begin(); it != runs_.end();) {
    const auto& [run, asked] = it->second;
    const uint64_t end = run.offset + (run.count - 1) * run.stride + run.length;
    if (asked + kPublishes < publishes_ || end > size) {
      ranges_ -= run.count;
      bytes_ -= run.count * run.length;
      it = runs_.erase(it);
      sorted_.reset();
    } else {
      ++it;
    }
  }
  if (!sorted_) {
    auto sorted = std::make_shared<Ranges>();
    sorted->reserve(ranges_);
    for (const auto& [offset, entry] : runs_) AppendRanges(entry.first, sorted.get());
    std::sort(sorted->begin(), sorted->end());
    sorted_ = std::move(sorted);
  }
  return sorted_;
}

}  // namespace refit
