#include "daemon/common/parallel.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"

namespace refit::common {
namespace {

TEST_CASE("ParallelFor runs every task once, on at most the threads asked", "[parallel]") {
  for (const unsigned threads : {1u, 2u, 8u}) {
    for (const size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{1000}}) {
      std::vector<std::atomic<int>> runs(count);
      std::mutex mu;
      std::set<std::thread::id> seen;
      ParallelFor(count, threads, [&](size_t i) {
        runs[i]++;
        std::lock_guard<std::mutex> lock(mu);
        seen.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < count; ++i) CHECK(runs[i] == 1);
      CHECK(seen.size() <= std::max<size_t>(1, std::min<size_t>(threads, count)));
    }
  }
}

TEST_CASE("ThreadsFor: one thread for small work, never more than 8 or the parts", "[parallel]") {
  CHECK(ThreadsFor(kParallelBytes - 1, 100) == 1);
  CHECK(ThreadsFor(uint64_t{1} << 40, 1) == 1);
  CHECK(ThreadsFor(uint64_t{1} << 40, 100) <= 8);
  CHECK(ThreadsFor(uint64_t{1} << 40, 100) >= 1);
  CHECK(ThreadsFor(uint64_t{1} << 40, 0) == 1);
}

}  // namespace
}  // namespace refit::common
