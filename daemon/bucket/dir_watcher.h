#pragma once

// Follows a directory tree (the bucket: DIR and its model directories) and calls back when
// something in it may have changed, so the importer looks again. Two sources, both always on
// unless disabled:
//   - inotify on DIR and every subdirectory down to `max_depth` (IN_CLOSE_WRITE, IN_MOVED_TO,
//     IN_CREATE, IN_DELETE, IN_MOVED_FROM; new subdirectories are watched as they appear);
//   - polling: a listing of the same tree (names, sizes, mtimes) compared with the last one,
//     every `poll_interval` when inotify is off or unavailable, else every
//     `poll_interval_with_inotify` — inotify sees nothing that another machine writes to an
//     NFS, Lustre, s3fs or gcsfuse mount, so polling is what works there.
//
//   auto watcher = DirWatcher::Start(dir, {}, [&] { wake the import worker; });
//   ...
//   watcher->Stop();  // or destroy it
//
// The callback runs on the watcher's own thread: once right after Start (so existing content
// is seen), then once per burst of changes (events are drained and coalesced first). It must
// not block for long and must not call Stop(); typically it signals a worker. A missed or
// extra call is harmless: the callback means "may have changed", never "this changed".
//
// Thread-safety: Start and Stop may be called from any thread; Stop returns within a few
// milliseconds (an eventfd wakes the thread's poll(); nothing blocks on a read) plus the time
// of a callback in progress. The destructor stops.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

namespace refit::bucket {

struct DirWatcherOptions {
  bool use_inotify = true;
  std::chrono::milliseconds poll_interval{1000};                // without inotify
  std::chrono::milliseconds poll_interval_with_inotify{10000};  // alongside inotify
  int max_depth = 1;  // 0: DIR only; 1: DIR and its subdirectories (the model directories)
};

class DirWatcher {
 public:
  // Starts watching `dir`, which must exist (NOT_FOUND otherwise). When inotify can't be set
  // up (no inotify, out of watches) it falls back to polling at `poll_interval` and logs it.
  static absl::StatusOr<std::unique_ptr<DirWatcher>> Start(std::string dir,
                                                           DirWatcherOptions options,
                                                           std::function<void()> on_change);
  ~DirWatcher();
  DirWatcher(const DirWatcher&) = delete;
  DirWatcher& operator=(const DirWatcher&) = delete;

  // Stops the thread and waits for it. Idempotent.
  void Stop();

  // True while inotify is in use (false: polling only).
  bool using_inotify() const { return inotify_fd_ >= 0; }
  // Times the callback ran (for tests and status).
  uint64_t callbacks() const { return callbacks_.load(); }

 private:
  DirWatcher(std::string dir, DirWatcherOptions options, std::function<void()> on_change);
  void Run();
  void AddWatches(const std::string& path, int depth);
  // Drains pending inotify events; true when any was seen.
  bool DrainEvents();
  // A fingerprint of the tree's listing.
  uint64_t Fingerprint() const;
  void Notify();

  const std::string dir_;
  const DirWatcherOptions options_;
  const std::function<void()> on_change_;
  int inotify_fd_ = -1;
  int wake_fd_ = -1;                                    // eventfd: Stop() writes it
  std::map<int, std::pair<std::string, int>> watches_;  // wd -> (path, depth); watcher thread
  std::atomic<uint64_t> callbacks_{0};
  common::Mutex stop_mu_;
  std::thread thread_;
};

}  // namespace refit::bucket
