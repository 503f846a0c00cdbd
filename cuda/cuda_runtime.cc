// The CUDA interface with CUDA (--config=cuda): devices, IPC regions and allocations. Copies and
// plan execution are in cuda_transfer.cc.
//
// Linked with the static CUDA runtime, so a binary built with it starts on a machine without a
// driver or GPU: the first runtime call then fails and DeviceCount() answers 0.

#include <cuda.h>  // driver API types only: cuMemGetAddressRange is fetched at run time
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda.h"
#include "cuda/cuda_internal.h"
#include "cuda/device_uuid.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {
namespace internal {

namespace {

std::mutex& StickyMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

absl::Status& Sticky() {
  static auto* sticky = new absl::Status;
  return *sticky;
}

}  // namespace

bool IsSticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clears the error where it isn't sticky, so the next call starts clean
  absl::Status status = absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
  if (IsSticky(error)) {
    std::lock_guard<std::mutex> lock(StickyMutex());
    if (Sticky().ok()) {
      Sticky() =
          absl::InternalError(absl::StrCat("sticky CUDA error, this process's CUDA context "
                                           "is lost: ",
                                           status.message()));
      Logger("cuda")->critical(
          "{}; every later CUDA call fails the same way: health is "
          "NOT_SERVING, restart refitd",
          std::string(Sticky().message()));
    }
  }
  return status;
}

absl::Status CheckDevice(int device) {
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no cuda device ", device, ": this refitd sees ", count, " (", Describe(), ")"));
  }
  return CudaStatus(cudaSetDevice(device), "cudaSetDevice");
}

}  // namespace internal

namespace {

using internal::CheckDevice;
using internal::CudaStatus;

// ---- IPC ----

// One imported allocation, shared by every region opened from its handle: importing a handle
// that is already open in this process is not something every driver allows, and torch's
// caching allocator hands out one handle per segment for many tensors.
struct IpcMapping {
  uint8_t* base = nullptr;
  uint64_t size = 0;  // of the whole allocation
  int references = 0;
};

using IpcKey = std::pair<int, std::string>;  // device, handle bytes

std::mutex& IpcMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

// Never destroyed: regions may outlive static destruction at exit.
std::map<IpcKey, IpcMapping>& IpcMappings() {
  static auto* mappings = new std::map<IpcKey, IpcMapping>;
  return *mappings;
}

void ReleaseIpc(const IpcKey& key) {
  std::lock_guard<std::mutex> lock(IpcMutex());
  auto it = IpcMappings().find(key);
  if (it == IpcMappings().end() || --it->second.references > 0) return;
  if (cudaSetDevice(key.first) == cudaSuccess) cudaIpcCloseMemHandle(it->second.base);
  cudaGetLastError();
  IpcMappings().erase(it);
}

class IpcRegion final : public Region {
 public:
  IpcRegion(IpcKey key, uint8_t* data, uint64_t offset, uint64_t size, uint64_t allocation)
      : Region(MemoryKind::kCuda, key.first, data, size),
        key_(std::move(key)),
        offset_(offset),
        allocation_(allocation) {}
  ~IpcRegion() override { ReleaseIpc(key_); }

  std::string Describe() const override {
    return absl::StrCat("cuda ipc device ", device(), " [", offset_, ", ", offset_ + size(),
                        ") of a ", allocation_, "-byte allocation");
  }

 private:
  IpcKey key_;
  uint64_t offset_;
  uint64_t allocation_;
};

// The allocation holding device pointer `ptr`: cuMemGetAddressRange from the driver, reached
// through the runtime so that nothing links against libcuda (which a machine without a GPU
// lacks).
absl::Status AllocationRange(const void* ptr, uint8_t** base, uint64_t* size) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    // 12000: the cuMemGetAddressRange ABI of CUDA 12 (the _v2 one, size_t sizes).
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetAddressRange>(nullptr);
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) {
    return absl::InternalError("the CUDA driver does not provide cuMemGetAddressRange");
  }
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  const CUresult result = get_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(ptr));
  if (result != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed: CUresult ", result));
  }
  *base = reinterpret_cast<uint8_t*>(range_base);
  *size = range_size;
  return absl::OkStatus();
}

// Opens (or shares) the mapping of `key`; the caller holds IpcMutex().
absl::StatusOr<IpcMapping*> ImportLocked(const IpcKey& key) {
  auto it = IpcMappings().find(key);
  if (it != IpcMappings().end()) {
    ++it->second.references;
    return &it->second;
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, key.second.data(), sizeof(handle));
  void* ptr = nullptr;
  const cudaError_t error = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    const absl::Status status = CudaStatus(error, "cudaIpcOpenMemHandle");
    if (error == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(std::string(status.message()));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open the CudaIpc handle on device ", key.first,
                     " (stale, malformed, or exported by this process?): ", status.message()));
  }
  IpcMapping mapping;
  mapping.references = 1;
  uint8_t* range_base = nullptr;
  const absl::Status range = AllocationRange(ptr, &range_base, &mapping.size);
  if (!range.ok()) {
    cudaIpcCloseMemHandle(ptr);
    return range;
  }
  // The handle names a whole allocation, so the mapping starts at its base; should a driver
  // ever map from inside it, only what lies after the pointer is ours.
  mapping.base = static_cast<uint8_t*>(ptr);
  mapping.size -= static_cast<uint64_t>(mapping.base - range_base);
  return &IpcMappings().emplace(key, mapping).first->second;
}

// ---- owned allocations ----

class DeviceRegion final : public Region {
 public:
  DeviceRegion(int device, uint8_t* data, uint64_t size)
      : Region(MemoryKind::kCuda, device, data, size) {}
  ~DeviceRegion() override {
    if (cudaSetDevice(device()) == cudaSuccess) cudaFree(data());
    cudaGetLastError();
  }
  std::string Describe() const override {
    return absl::StrCat("cuda slot of ", size(), " bytes on device ", device());
  }
};

class PinnedHostRegion final : public Region {
 public:
  PinnedHostRegion(uint8_t* data, uint64_t size) : Region(MemoryKind::kHost, -1, data, size) {}
  ~PinnedHostRegion() override {
    cudaFreeHost(data());
    cudaGetLastError();
  }
  std::string Describe() const override {
    return absl::StrCat("pinned host slot of ", size(), " bytes");
  }
};

std::string VersionString(int version) {
  return absl::StrCat(version / 1000, ".", version % 1000 / 10);
}

}  // namespace

bool CompiledIn() { return true; }

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string Describe() {
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("cuda: ", VersionString(runtime), ", 0 device(s) (",
                        cudaGetErrorName(error), ")");
  }
  int driver = 0;
  cudaDriverGetVersion(&driver);
  return absl::StrCat("cuda: ", VersionString(runtime), ", ", count, " device(s), driver ",
                      VersionString(driver));
}

namespace {

// Every device's UUID, read once: the devices a process sees don't change while it runs.
const std::vector<GpuUuid>& DeviceUuids() {
  static const auto* uuids = [] {
    auto* out = new std::vector<GpuUuid>;
    for (int device = 0; device < DeviceCount(); ++device) {
      cudaDeviceProp properties{};
      GpuUuid uuid{};
      if (CudaStatus(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties")
              .ok()) {
        std::memcpy(uuid.data(), properties.uuid.bytes, uuid.size());
      }
      out->push_back(uuid);  // all zero if unreadable: matches no client's
    }
    return out;
  }();
  return *uuids;
}

}  // namespace

absl::StatusOr<int> DeviceByUuid(const std::string& text) {
  ASSIGN_OR_RETURN(const GpuUuid uuid, ParseGpuUuid(text));
  const std::vector<GpuUuid>& uuids = DeviceUuids();
  std::vector<std::string> seen;
  for (size_t device = 0; device < uuids.size(); ++device) {
    if (uuids[device] == uuid) return static_cast<int>(device);
    seen.push_back(FormatGpuUuid(uuids[device]));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("this node has no GPU ", FormatGpuUuid(uuid), "; refitd sees ", uuids.size(),
                   " device(s)", seen.empty() ? "" : ": ", absl::StrJoin(seen, ", ")));
}

std::string DeviceUuid(int device) {
  const std::vector<GpuUuid>& uuids = DeviceUuids();
  if (device < 0 || static_cast<size_t>(device) >= uuids.size()) return "";
  return FormatGpuUuid(uuids[device]);
}

absl::Status StickyError() {
  std::lock_guard<std::mutex> lock(internal::StickyMutex());
  return internal::Sticky();
}

absl::StatusOr<std::unique_ptr<Region>> OpenIpc(const std::string& handle, int device,
                                                uint64_t offset, uint64_t size) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CudaIpc handle is ", sizeof(cudaIpcMemHandle_t),
                     " bytes (a cudaIpcMemHandle_t), not ", handle.size()));
  }
  RETURN_IF_ERROR(CheckDevice(device));
  IpcKey key(device, handle);
  std::lock_guard<std::mutex> lock(IpcMutex());
  ASSIGN_OR_RETURN(IpcMapping * mapping, ImportLocked(key));
  const uint64_t allocation = mapping->size;
  if (size == 0 && offset < allocation) size = allocation - offset;
  if (size == 0 || offset > allocation || size > allocation - offset) {
    // Not ReleaseIpc: it takes the lock held here.
    if (--mapping->references == 0) {
      cudaIpcCloseMemHandle(mapping->base);
      cudaGetLastError();
      IpcMappings().erase(key);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("region [", offset, ", ", offset + size, ") does not fit in the ", allocation,
                     "-byte CUDA allocation behind the handle (device ", device, ")"));
  }
  return std::unique_ptr<Region>(
      new IpcRegion(key, mapping->base + offset, offset, size, allocation));
}

absl::StatusOr<std::unique_ptr<Region>> AllocateDevice(uint64_t size, int device) {
  RETURN_IF_ERROR(CheckDevice(device));
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, size == 0 ? 1 : size);
  if (error != cudaSuccess) {
    const absl::Status status = CudaStatus(error, "cudaMalloc");
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate a ", size, "-byte slot on cuda device ", device, ": ", status.message()));
  }
  return std::unique_ptr<Region>(new DeviceRegion(device, static_cast<uint8_t*>(ptr), size));
}

absl::StatusOr<std::unique_ptr<Region>> AllocatePinnedHost(uint64_t size) {
  if (DeviceCount() == 0) return AllocateHost(size);
  void* ptr = nullptr;
  const cudaError_t error = cudaHostAlloc(&ptr, size == 0 ? 1 : size, cudaHostAllocPortable);
  if (error != cudaSuccess) {
    const absl::Status status = CudaStatus(error, "cudaHostAlloc");
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", size, "-byte pinned host slot: ", status.message()));
  }
  return std::unique_ptr<Region>(new PinnedHostRegion(static_cast<uint8_t*>(ptr), size));
}

}  // namespace refit::cuda
