#include "daemon/bucket/dir_watcher.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/bucket/file_io.h"
#include "daemon/common/logging.h"
#include "daemon/common/xxh3.h"

namespace refit::bucket {
namespace {

constexpr uint32_t kWatchMask = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE |
                                IN_MOVED_FROM | IN_DELETE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK;

// Temporary files (".tmp.*") come and go while a writer works; only their renames matter.
bool Hidden(const char* name) { return name[0] == '.'; }

void FingerprintTree(const std::string& path, int depth, int max_depth, XXH3_state_t* state) {
  auto entries = internal::ListDir(path);
  if (!entries.ok()) {
    XXH3_64bits_update(state, "missing", 7);
    return;
  }
  for (const internal::DirEntry& entry : *entries) {
    if (Hidden(entry.name.c_str())) continue;
    XXH3_64bits_update(state, entry.name.data(), entry.name.size() + 1);  // with the NUL
    // A directory's own size and mtime change with every temporary file in it; below the
    // depth limit its listing says what matters instead.
    const bool listed = entry.is_dir && depth < max_depth;
    const uint64_t facts[3] = {listed ? 0 : entry.size,
                               listed ? 0 : static_cast<uint64_t>(entry.mtime_ns),
                               entry.is_dir ? uint64_t{1} : 0};
    XXH3_64bits_update(state, facts, sizeof(facts));
    if (listed) {
      FingerprintTree(absl::StrCat(path, "/", entry.name), depth + 1, max_depth, state);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirWatcher>> DirWatcher::Start(std::string dir,
                                                              DirWatcherOptions options,
                                                              std::function<void()> on_change) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return internal::ErrnoStatus(errno, "stat", dir);
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a directory"));
  }
  if (options.poll_interval.count() <= 0 || options.poll_interval_with_inotify.count() <= 0) {
    return absl::InvalidArgumentError("poll intervals must be positive");
  }
  std::unique_ptr<DirWatcher> watcher(
      new DirWatcher(std::move(dir), options, std::move(on_change)));
  watcher->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (watcher->wake_fd_ < 0) return internal::ErrnoStatus(errno, "eventfd for", watcher->dir_);
  if (options.use_inotify) {
    watcher->inotify_fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (watcher->inotify_fd_ < 0) {
      Logger("bucket")->warn("dir={}: no inotify ({}); polling every {} ms", watcher->dir_,
                             std::strerror(errno), options.poll_interval.count());
    } else {
      watcher->AddWatches(watcher->dir_, 0);
      if (watcher->watches_.empty()) {  // AddWatches logged why
        close(watcher->inotify_fd_);
        watcher->inotify_fd_ = -1;
      }
    }
  }
  watcher->thread_ = std::thread([w = watcher.get()] { w->Run(); });
  return watcher;
}

DirWatcher::DirWatcher(std::string dir, DirWatcherOptions options, std::function<void()> on_change)
    : dir_(std::move(dir)), options_(options), on_change_(std::move(on_change)) {}

DirWatcher::~DirWatcher() {
  Stop();
  if (inotify_fd_ >= 0) close(inotify_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void DirWatcher::Stop() {
  common::MutexLock lock(stop_mu_);
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  while (write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  thread_.join();
}

void DirWatcher::AddWatches(const std::string& path, int depth) {
  const int wd = inotify_add_watch(inotify_fd_, path.c_str(), kWatchMask);
  if (wd < 0) {
    if (errno != ENOENT && errno != ENOTDIR) {
      Logger("bucket")->warn("dir={}: cannot watch {} ({}); polling finds its changes", dir_, path,
                             std::strerror(errno));
    }
    return;
  }
  watches_[wd] = {path, depth};
  if (depth >= options_.max_depth) return;
  auto entries = internal::ListDir(path);
  if (!entries.ok()) return;
  for (const internal::DirEntry& entry : *entries) {
    if (entry.is_dir && !Hidden(entry.name.c_str())) {
      AddWatches(absl::StrCat(path, "/", entry.name), depth + 1);
    }
  }
}

bool DirWatcher::DrainEvents() {
  alignas(struct inotify_event) char buffer[16384];
  bool changed = false;
  for (;;) {
    const ssize_t n = read(inotify_fd_, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return changed;  // EAGAIN: drained
    }
    if (n == 0) return changed;
    for (ssize_t at = 0; at < n;) {
      const auto* event = reinterpret_cast<const struct inotify_event*>(buffer + at);
      at += static_cast<ssize_t>(sizeof(struct inotify_event) + event->len);
      if (event->mask & IN_Q_OVERFLOW) {
        changed = true;
        continue;
      }
      auto watch = watches_.find(event->wd);
      if (event->mask & IN_IGNORED) {
        if (watch != watches_.end()) watches_.erase(watch);
        changed = true;
        continue;
      }
      if (watch == watches_.end()) continue;
      if (event->len == 0 || Hidden(event->name)) {
        changed = changed || (event->mask & IN_DELETE_SELF) != 0;
        continue;
      }
      changed = true;
      if ((event->mask & IN_ISDIR) && (event->mask & (IN_CREATE | IN_MOVED_TO)) &&
          watch->second.second < options_.max_depth) {
        const auto [path, depth] = watch->second;  // copy: AddWatches changes the map
        AddWatches(absl::StrCat(path, "/", event->name), depth + 1);
      }
    }
  }
}

uint64_t DirWatcher::Fingerprint() const {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return 0;
  XXH3_64bits_reset(state);
  FingerprintTree(dir_, 0, options_.max_depth, state);
  const uint64_t value = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return value;
}

void DirWatcher::Notify() {
  on_change_();
  callbacks_.fetch_add(1);
}

void DirWatcher::Run() {
  using Clock = std::chrono::steady_clock;
  const auto interval =
      inotify_fd_ >= 0 ? options_.poll_interval_with_inotify : options_.poll_interval;
  uint64_t fingerprint = Fingerprint();
  Notify();
  auto next_poll = Clock::now() + interval;
  for (;;) {
    const auto wait =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_poll - Clock::now());
    struct pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {inotify_fd_, POLLIN, 0}};
    const int ready = poll(fds, inotify_fd_ >= 0 ? 2 : 1,
                           static_cast<int>(std::max<int64_t>(0, wait.count() + 1)));
    if (ready < 0 && errno != EINTR) {
      Logger("bucket")->error("dir={}: poll failed ({}); the watcher stops", dir_,
                              std::strerror(errno));
      return;
    }
    if (ready > 0 && (fds[0].revents & POLLIN)) return;  // Stop()
    if (ready > 0 && (fds[1].revents & POLLIN)) {
      if (DrainEvents()) {
        fingerprint = Fingerprint();
        Notify();
      }
    }
    if (Clock::now() >= next_poll) {
      if (inotify_fd_ >= 0) AddWatches(dir_, 0);  // directories created before their watch
      const uint64_t now = Fingerprint();
      if (now != fingerprint) {
        fingerprint = now;
        Notify();
      }
      next_poll = Clock::now() + interval;
    }
  }
}

}  // namespace refit::bucket
