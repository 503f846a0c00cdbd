#include "daemon/store/store_types.h"

namespace refit {

uint64_t PullJob::Bytes() const {
  uint64_t total = 0;
  for (const Fetch& f : fetches) {
    for (const auto& [begin, end] : f.ranges) total += end - begin;
  }
  return total;
}

}  // namespace refit
