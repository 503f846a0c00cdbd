#include "daemon/bucket/file_io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/bucket/format.h"

namespace refit::bucket::internal {

Fd::~Fd() {
  if (fd_ >= 0) close(fd_);
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

absl::Status ErrnoStatus(int error, const std::string& what, const std::string& path) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case EIO:
    case ESTALE:
    case ETIMEDOUT:
    case EAGAIN:
    case ENOTCONN:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status MakeDirs(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, "mkdir", prefix);
    }
    if (slash == std::string::npos) break;
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const uint8_t* at = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, at, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path);
    }
    at += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PreadExactly(int fd, void* data, size_t size, uint64_t offset,
                          const std::string& path) {
  uint8_t* at = static_cast<uint8_t*>(data);
  while (size > 0) {
    const ssize_t n =
        pread(fd, at, std::min<size_t>(size, size_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", path);
    }
    if (n == 0) return absl::DataLossError(absl::StrCat(path, ": truncated (ends early)"));
    at += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

namespace {

absl::Status SyncDir(const std::string& dir) {
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, "open", dir);
  // Some FUSE file systems don't implement fsync on directories; the rename is what matters.
  if (fsync(fd.get()) != 0 && errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return ErrnoStatus(errno, "fsync", dir);
  }
  return absl::OkStatus();
}

std::atomic<uint64_t> temp_counter{0};

}  // namespace

absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, bool sync,
                                 const std::function<absl::Status(int fd)>& write) {
  const std::string temp =
      absl::StrCat(dir, "/", kTempPrefix, name, ".", getpid(), ".", temp_counter.fetch_add(1));
  const std::string final_path = absl::StrCat(dir, "/", name);
  absl::Status status = [&]() -> absl::Status {
    Fd fd(open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) return ErrnoStatus(errno, "create", temp);
    absl::Status written = write(fd.get());
    if (!written.ok()) return written;
    if (sync && fsync(fd.get()) != 0) return ErrnoStatus(errno, "fsync", temp);
    if (close(fd.release()) != 0) return ErrnoStatus(errno, "close", temp);
    if (rename(temp.c_str(), final_path.c_str()) != 0) {
      return ErrnoStatus(errno, "rename to " + final_path, temp);
    }
    return sync ? SyncDir(dir) : absl::OkStatus();
  }();
  if (!status.ok()) unlink(temp.c_str());
  return status;
}

absl::StatusOr<Fd> OpenForRead(const std::string& path) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, "open", path);
  return fd;
}

absl::StatusOr<uint64_t> FileSize(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrCat(path, " is not a regular file"));
  }
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  auto fd = OpenForRead(path);
  if (!fd.ok()) return fd.status();
  auto size = FileSize(fd->get(), path);
  if (!size.ok()) return size.status();
  if (*size > max_bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", *size, " bytes, more than the limit of ", max_bytes));
  }
  std::string text(*size, '\0');
  absl::Status read = PreadExactly(fd->get(), text.data(), text.size(), 0, path);
  if (!read.ok()) return read;
  return text;
}

absl::StatusOr<std::vector<DirEntry>> ListDir(const std::string& dir) {
  DIR* handle = opendir(dir.c_str());
  if (handle == nullptr) return ErrnoStatus(errno, "opendir", dir);
  std::vector<DirEntry> entries;
  errno = 0;
  while (struct dirent* entry = readdir(handle)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (lstat(absl::StrCat(dir, "/", name).c_str(), &st) != 0) continue;  // gone meanwhile
    DirEntry out;
    out.name = name;
    out.is_dir = S_ISDIR(st.st_mode);
    out.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    out.size = static_cast<uint64_t>(st.st_size);
    entries.push_back(std::move(out));
  }
  closedir(handle);
  std::sort(entries.begin(), entries.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return entries;
}

absl::Status RemoveFile(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "unlink", path);
  return absl::OkStatus();
}

}  // namespace refit::bucket::internal
