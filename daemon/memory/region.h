#pragma once

// Memory regions the daemon reads and writes: a client's buffer (borrowed: POSIX shared memory
// mapped from the client's shm_open name or from a sealed memfd the client passed, or a CUDA
// allocation opened from an IPC handle) or the
// daemon's own version slots (owned). Every region is {kind, device, pointer, size}; code that
// copies between regions checks the kind rather than assuming host memory.
//
// A Region is immutable after construction and may be used from any thread; the bytes it points
// to are synchronized by its users (the store).

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace refit {

enum class MemoryKind { kHost, kCuda };
const char* MemoryKindName(MemoryKind kind);

class Region {
 public:
  virtual ~Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }  // CUDA ordinal; -1 for host memory
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // "host shm /trainer-0 [0, 4096)", for logs and errors.
  virtual std::string Describe() const = 0;
  // The memory went away under the daemon (a client truncated its shm object): its bytes are
  // zeros now, and whatever was read from or written to it since is not the client's
  // (fault_guard.h). Client buffers only; never true for the daemon's own slots.
  virtual bool Broken() const { return false; }
  // Which memory this is, for telling a second registration of the same memory (RegisterBuffer
  // is idempotent for it): "dev:inode [offset, end)" of the shm object or memfd a client region
  // maps; empty for memory without such an identity (CUDA, the daemon's own slots).
  virtual std::string Identity() const { return ""; }

 protected:
  Region(MemoryKind kind, int device, uint8_t* data, uint64_t size)
      : kind_(kind), device_(device), data_(data), size_(size) {}

 private:
  MemoryKind kind_;
  int device_;
  uint8_t* data_;
  uint64_t size_;
};

// Maps [offset, offset + size) of the POSIX shared-memory object `name` read-write. `size` 0
// means "to the end of the object". NOT_FOUND when the object doesn't exist; INVALID_ARGUMENT
// for a malformed name or when the object (fstat) is smaller than offset + size. The mapping is
// guarded (fault_guard.h): if the client shrinks the object later, Broken() turns true instead
// of the daemon dying of SIGBUS.
// `allow` (optional) sees the object's fstat first and may refuse it (PERMISSION_DENIED for a
// caller who couldn't open it itself).
absl::StatusOr<std::unique_ptr<Region>> MapHostShm(
    const std::string& name, uint64_t offset, uint64_t size,
    const std::function<absl::Status(const struct stat&)>& allow = nullptr);

// Maps [offset, offset + size) of the memfd `fd` read-write, as MapHostShm does a shm object
// (`size` 0: to the end). The caller keeps `fd` and may close it at once. The file must be
// sealed against shrinking (F_SEAL_SHRINK): then it can never shrink under the mapping. A file
// without that seal (or not sealable: not a memfd) is FAILED_PRECONDITION, and so is one sealed
// against writes (refitd maps buffers read-write); an fd not open read-write is
// PERMISSION_DENIED; a region past the file's size (fstat) INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<Region>> MapSealedMemfd(int fd, uint64_t offset, uint64_t size);

// `size` bytes of daemon-owned, page-aligned host memory, faulted in up front so that the first
// copy into it runs at memcpy speed. RESOURCE_EXHAUSTED when the memory can't be had.
absl::StatusOr<std::unique_ptr<Region>> AllocateHost(uint64_t size);

}  // namespace refit
