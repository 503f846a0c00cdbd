#include "daemon/common/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace refit::common {

unsigned ThreadsFor(uint64_t bytes, size_t count) {
  if (bytes < kParallelBytes) return 1;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::min<uint64_t>({cores, 8u, std::max<size_t>(1, count)}));
}

void ParallelFor(size_t count, unsigned threads, const std::function<void(size_t)>& task) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < count; i = next++) task(i);
  };
  std::vector<std::thread> pool;
  const unsigned extra = static_cast<unsigned>(std::min<size_t>(threads, count));
  for (unsigned t = 1; t < extra; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace refit::common
