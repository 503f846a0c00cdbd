#include "daemon/memory/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/memory/fault_guard.h"

namespace refit {
namespace {

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// A mapping of part of a shared-memory object; unmapped on destruction.
class HostShmRegion final : public Region {
 public:
  // `what`: "shm /trainer-0" or "memfd refit-trainer".
  HostShmRegion(std::string what, std::string identity, void* map_base, uint64_t map_length,
                uint64_t offset, uint64_t size, uint8_t* data)
      : Region(MemoryKind::kHost, -1, data, size),
        name_(std::move(what)),
        identity_(std::move(identity)),
        map_base_(map_base),
        map_length_(map_length),
        offset_(offset),
        guard_(std::make_unique<FaultGuard>(map_base, map_length)) {}
  ~HostShmRegion() override {
    guard_.reset();  // before the mapping goes: a later fault there is not this region's
    munmap(map_base_, map_length_);
  }

  std::string Describe() const override {
    return absl::StrCat("host ", name_, " [", offset_, ", ", offset_ + size(), ")");
  }
  bool Broken() const override { return guard_->Broken(); }
  std::string Identity() const override { return identity_; }
  bool guarded() const { return guard_->ok(); }

 private:
  std::string name_;
  std::string identity_;
  void* map_base_;
  uint64_t map_length_;
  uint64_t offset_;
  std::unique_ptr<FaultGuard> guard_;
};

// Anonymous private memory owned by the daemon.
class OwnedHostRegion final : public Region {
 public:
  OwnedHostRegion(uint8_t* data, uint64_t size, uint64_t length)
      : Region(MemoryKind::kHost, -1, data, size), length_(length) {}
  ~OwnedHostRegion() override { munmap(data(), length_); }
  std::string Describe() const override { return absl::StrCat("host slot of ", size(), " bytes"); }

 private:
  uint64_t length_;
};

// Maps [offset, offset + size) of the shared file `fd` of `object_size` bytes, guarded. `what`
// names it in Describe() ("shm /x"), `object` in errors ("shm object /x").
absl::StatusOr<std::unique_ptr<Region>> MapShared(int fd, const struct stat& st,
                                                  const std::string& what,
                                                  const std::string& object, uint64_t offset,
                                                  uint64_t size) {
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (size == 0) size = offset < object_size ? object_size - offset : 0;
  if (size == 0 || offset > object_size || size > object_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("region [", offset, ", ", offset + size,
                                                   ") does not fit in ", object, " of ",
                                                   object_size, " bytes"));
  }
  const uint64_t map_offset = offset - offset % PageSize();
  const uint64_t map_length = size + (offset - map_offset);
  // Populated up front (no page faults in the first copy) unless the file has holes: populating
  // a sparse memfd or shm object would allocate every hole's pages in refitd's name before any
  // cap is checked (a 1 GiB hole: 1 GiB of refitd's memory; issue 37). A sparse one's pages
  // fault in as a Publish or Apply touches them, after --max-slot-memory has been checked.
  const bool sparse = static_cast<uint64_t>(st.st_blocks) * 512 < object_size;
  void* base = mmap(nullptr, map_length, PROT_READ | PROT_WRITE,
                    MAP_SHARED | (sparse ? 0 : MAP_POPULATE), fd, static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", object, " failed: ", std::strerror(errno)));
  }
  uint8_t* data = static_cast<uint8_t*>(base) + (offset - map_offset);
  const std::string identity =
      absl::StrCat(static_cast<uint64_t>(st.st_dev), ":", static_cast<uint64_t>(st.st_ino), " [",
                   offset, ", ", offset + size, ")");
  auto region =
      std::make_unique<HostShmRegion>(what, identity, base, map_length, offset, size, data);
  if (!region->guarded()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", object, ": ",
                                                     FaultGuard::kMaxGuarded,
                                                     " client regions are registered already"));
  }
  return std::unique_ptr<Region>(std::move(region));
}

}  // namespace

const char* MemoryKindName(MemoryKind kind) { return kind == MemoryKind::kCuda ? "cuda" : "host"; }

absl::StatusOr<std::unique_ptr<Region>> MapHostShm(
    const std::string& given, uint64_t offset, uint64_t size,
    const std::function<absl::Status(const struct stat&)>& allow) {
  // "/trainer-rank3", or without the leading '/' as Python's SharedMemory.name gives it (glibc's
  // shm_open takes both the same way).
  const std::string name = !given.empty() && given[0] != '/' ? "/" + given : given;
  if (name.size() < 2 || name.find('/', 1) != std::string::npos || name.size() > 255 ||
      name == "/." || name == "/..") {
    return absl::InvalidArgumentError(
        absl::StrCat("host_shm name '", given,
                     "' is not a POSIX shm name (one leading '/', no other '/', not . or ..)"));
  }
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("shm object ", name, " does not exist"));
    }
    if (err == EINVAL || err == ENAMETOOLONG) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host_shm name '", given, "' is not a POSIX shm name: ", std::strerror(err)));
    }
    if (err == EMFILE || err == ENFILE) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot open shm object ", name, ": ", std::strerror(err)));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open shm object ", name, ": ", std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of ", name, ": ", std::strerror(err)));
  }
  if (allow) {
    absl::Status allowed = allow(st);
    if (!allowed.ok()) {
      close(fd);
      return allowed;
    }
  }
  auto region = MapShared(fd, st, absl::StrCat("shm ", name), absl::StrCat("shm object ", name),
                          offset, size);
  close(fd);
  return region;
}

absl::StatusOr<std::unique_ptr<Region>> MapSealedMemfd(int fd, uint64_t offset, uint64_t size) {
  // "/memfd:refit-trainer (deleted)" names it in errors and logs.
  std::string what = "memfd";
  char link[512];
  const ssize_t length =
      readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
  if (length > 0) {
    std::string target(link, static_cast<size_t>(length));
    if (target.rfind("/memfd:", 0) == 0) target = target.substr(7);
    if (const size_t deleted = target.rfind(" (deleted)"); deleted != std::string::npos) {
      target.resize(deleted);
    }
    what = absl::StrCat("memfd ", target);
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        " is not sealed against shrinking: refitd maps only memory that cannot shrink "
        "under it (create it with memfd_create(MFD_ALLOW_SEALING) and add F_SEAL_SHRINK "
        "with fcntl(F_ADD_SEALS) before passing it",
        seals < 0 ? absl::StrCat("; F_GET_SEALS: ", std::strerror(errno)) : "", ")"));
  }
  if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        " is sealed against writes; refitd maps buffers read-write (seal F_SEAL_SHRINK "
        "and F_SEAL_GROW only)"));
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return absl::PermissionDeniedError(
        absl::StrCat("the fd of ", what, " is not open for reading and writing"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("fstat of ", what, ": ", std::strerror(errno)));
  }
  return MapShared(fd, st, what, what, offset, size);
}

absl::StatusOr<std::unique_ptr<Region>> AllocateHost(uint64_t size) {
  if (size > UINT64_MAX - PageSize()) {  // rounded up to pages below, it would wrap to 0
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", size, "-byte version slot: too large"));
  }
  const uint64_t length =
      std::max<uint64_t>(PageSize(), (size + PageSize() - 1) / PageSize() * PageSize());
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", size, "-byte version slot: ", std::strerror(errno)));
  }
  return std::unique_ptr<Region>(new OwnedHostRegion(static_cast<uint8_t*>(base), size, length));
}

}  // namespace refit
