#pragma once

// Internal to daemon/bucket: the POSIX file operations the exporter and importer need, with
// errno turned into absl::Status (ENOENT → NOT_FOUND, ENOSPC → RESOURCE_EXHAUSTED, EIO, ESTALE
// and timeouts → UNAVAILABLE, ...). Files are written under a temporary name and renamed, so a
// reader never sees a partly written file under its final name. Thread-safe (no shared state
// besides a counter for temporary names).

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::bucket::internal {

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// A status for the failed call `what` on `path` with `error` (an errno value).
absl::Status ErrnoStatus(int error, const std::string& what, const std::string& path);

// mkdir -p (mode 0755). OK when the directory exists.
absl::Status MakeDirs(const std::string& path);

// Writes every byte, retrying short writes and EINTR.
absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path);
// Reads exactly `size` bytes at `offset`; DATA_LOSS when the file ends first.
absl::Status PreadExactly(int fd, void* data, size_t size, uint64_t offset,
                          const std::string& path);

// Creates dir/<temporary name>, calls `write` with its descriptor, fsyncs it (when `sync`),
// renames it to dir/name and fsyncs the directory (when `sync`). On any failure the temporary
// file is removed and nothing appears under `name`. Replaces an existing `name`.
absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, bool sync,
                                 const std::function<absl::Status(int fd)>& write);

// Opens `path` read-only. NOT_FOUND when it doesn't exist.
absl::StatusOr<Fd> OpenForRead(const std::string& path);
// The size of an open file.
absl::StatusOr<uint64_t> FileSize(int fd, const std::string& path);
// A whole small file; DATA_LOSS when it is larger than `max_bytes`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);

struct DirEntry {
  std::string name;
  bool is_dir = false;
  int64_t mtime_ns = 0;
  uint64_t size = 0;
};
// The entries of `dir` other than "." and "..", sorted by name (stat'ed; entries that vanish
// meanwhile are left out). NOT_FOUND when `dir` doesn't exist.
absl::StatusOr<std::vector<DirEntry>> ListDir(const std::string& dir);

// unlink(); OK when the file is already gone.
absl::Status RemoveFile(const std::string& path);

}  // namespace refit::bucket::internal
