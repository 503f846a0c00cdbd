// DirWatcher: inotify sees a file renamed into the directory or a model directory (with the
// polling fallback slowed down so that only inotify can be what fired), polling alone sees it
// when inotify is off, temporary files don't fire, and Stop() returns at once.

#include "daemon/bucket/dir_watcher.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "daemon/bucket/temp_dir_testing.h"

namespace refit::bucket {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using testing::TempDir;

// Counts callbacks; waits for a count with a bound.
class Counter {
 public:
  void Bump() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
    cv_.notify_all();
  }
  bool WaitFor(int at_least, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return count_ >= at_least; });
  }
  int count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
};

void WriteAndRename(const std::string& dir, const std::string& name) {
  const std::string temp = dir + "/.tmp." + name;
  std::ofstream(temp) << "x";
  REQUIRE(rename(temp.c_str(), (dir + "/" + name).c_str()) == 0);
}

TEST_CASE("inotify: a file renamed into the directory or a new subdirectory fires",
          "[bucket][watcher]") {
  TempDir dir;
  REQUIRE(mkdir((dir.path() + "/model-a").c_str(), 0755) == 0);
  Counter counter;
  DirWatcherOptions options;
  options.poll_interval_with_inotify = 3600s;  // only inotify can fire within the test
  auto watcher = DirWatcher::Start(dir.path(), options, [&] { counter.Bump(); });
  REQUIRE(watcher.ok());
  REQUIRE((*watcher)->using_inotify());
  REQUIRE(counter.WaitFor(1, 5s));  // the initial call

  WriteAndRename(dir.path() + "/model-a", "v1.manifest.json");
  REQUIRE(counter.WaitFor(2, 5s));

  // A model directory that appears later is watched too.
  const int before = counter.count();
  REQUIRE(mkdir((dir.path() + "/model-b").c_str(), 0755) == 0);
  REQUIRE(counter.WaitFor(before + 1, 5s));
  std::this_thread::sleep_for(50ms);  // the watch on model-b is added by the watcher thread
  const int after_mkdir = counter.count();
  WriteAndRename(dir.path() + "/model-b", "v1.manifest.json");
  REQUIRE(counter.WaitFor(after_mkdir + 1, 5s));

  const auto start = Clock::now();
  (*watcher)->Stop();
  CHECK(Clock::now() - start < 500ms);
  (*watcher)->Stop();  // idempotent
}

TEST_CASE("polling alone finds changes when inotify is off", "[bucket][watcher]") {
  TempDir dir;
  Counter counter;
  DirWatcherOptions options;
  options.use_inotify = false;
  options.poll_interval = 20ms;
  auto watcher = DirWatcher::Start(dir.path(), options, [&] { counter.Bump(); });
  REQUIRE(watcher.ok());
  CHECK_FALSE((*watcher)->using_inotify());
  REQUIRE(counter.WaitFor(1, 5s));

  // Nothing changes: no calls over many intervals. A temporary file doesn't count either.
  std::this_thread::sleep_for(200ms);
  CHECK(counter.count() == 1);
  std::ofstream(dir.path() + "/.tmp.partial") << "x";
  std::this_thread::sleep_for(200ms);
  CHECK(counter.count() == 1);

  REQUIRE(mkdir((dir.path() + "/model").c_str(), 0755) == 0);
  REQUIRE(counter.WaitFor(2, 5s));
  std::this_thread::sleep_for(100ms);
  const int before = counter.count();
  WriteAndRename(dir.path() + "/model", "v1.manifest.json");  // one level down
  REQUIRE(counter.WaitFor(before + 1, 5s));

  const auto start = Clock::now();
  watcher->reset();  // the destructor stops
  CHECK(Clock::now() - start < 500ms);
}

TEST_CASE("Stop() returns promptly even with long poll intervals", "[bucket][watcher]") {
  TempDir dir;
  for (const bool inotify : {true, false}) {
    DirWatcherOptions options;
    options.use_inotify = inotify;
    options.poll_interval = 3600s;
    options.poll_interval_with_inotify = 3600s;
    Counter counter;
    auto watcher = DirWatcher::Start(dir.path(), options, [&] { counter.Bump(); });
    REQUIRE(watcher.ok());
    REQUIRE(counter.WaitFor(1, 5s));
    const auto start = Clock::now();
    (*watcher)->Stop();
    CHECK(Clock::now() - start < 500ms);
  }
}

TEST_CASE("a missing directory is NOT_FOUND", "[bucket][watcher]") {
  auto watcher = DirWatcher::Start("/nonexistent/bucket", {}, [] {});
  CHECK(watcher.status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace refit::bucket
