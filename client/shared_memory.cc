// SharedMemory (sealed memfds and named POSIX shm objects), Slice and DTypeBytes of the C++
// client (refit_client.h).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/refit_client.h"

namespace refit::client {

// ---- SharedMemory ----

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t size,
                                                  bool replace) {
  if (size == 0) return absl::InvalidArgumentError("shared memory size must be > 0");
  if (replace) shm_unlink(name.c_str());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0660);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) return absl::AlreadyExistsError(absl::StrCat(name, " already exists"));
    return absl::InvalidArgumentError(absl::StrCat("shm_open ", name, ": ", std::strerror(err)));
  }
  // The daemon may run as another user of the same group: the umask must not take g+rw away.
  (void)fchmod(fd, 0660);
  // posix_fallocate reserves the pages now, so running out of /dev/shm is an error here rather
  // than a SIGBUS later.
  int err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve ", size, " bytes for ", name, ": ", std::strerror(err)));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", name, ": ", std::strerror(err)));
  }
  return SharedMemory(name, static_cast<uint8_t*>(p), size, /*owner=*/true);
}

absl::StatusOr<SharedMemory> SharedMemory::CreateSealed(uint64_t size, const std::string& label) {
  if (size == 0) return absl::InvalidArgumentError("shared memory size must be > 0");
  // memfd names are at most 249 bytes.
  int fd = memfd_create(label.substr(0, 200).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create ", label, ": ", std::strerror(errno)));
  }
  auto fail = [&](const char* what) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " of memfd ", label, " (", size, " bytes): ", std::strerror(err)));
  };
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate");
  // Reserve the pages now (as Create does): running out of memory is an error here.
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    errno = err;
    return fail("posix_fallocate");
  }
  // Its size is final: refitd refuses memfds that could shrink under its mappings.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("sealing");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  return SharedMemory("", static_cast<uint8_t*>(p), size, /*owner=*/true, fd);
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    return absl::InvalidArgumentError(absl::StrCat("shm_open ", name, ": ", std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(name, " is empty"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", name, ": ", std::strerror(err)));
  }
  return SharedMemory(name, static_cast<uint8_t*>(p), size, /*owner=*/false);
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept { *this = std::move(other); }

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

SharedMemory::~SharedMemory() { Reset(); }

void SharedMemory::Reset() {
  if (data_) munmap(data_, size_);
  if (owner_ && fd_ < 0) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  owner_ = false;
  fd_ = -1;
}

// ---- helpers ----

v1::TensorSlice Slice(const std::string& name, v1::DType dtype,
                      const std::vector<int64_t>& global_shape, uint64_t buffer_offset,
                      const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                      const std::vector<int64_t>& buffer_strides) {
  v1::TensorSlice s;
  s.set_name(name);
  s.set_dtype(dtype);
  for (int64_t d : global_shape) s.add_global_shape(d);
  for (int64_t d : offsets) s.add_offsets(d);
  for (int64_t d : sizes) s.add_sizes(d);
  s.set_buffer_offset(buffer_offset);
  for (int64_t d : buffer_strides) s.add_buffer_strides(d);
  return s;
}

uint64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::BF16:
    case v1::FP16:
      return 2;
    case v1::FP32:
    case v1::INT32:
      return 4;
    case v1::INT64:
      return 8;
    case v1::FP8_E4M3:
    case v1::FP8_E5M2:
    case v1::INT8:
    case v1::UINT8:
      return 1;
    default:
      return 0;
  }
}

}  // namespace refit::client
