#include "client/cuda_ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/device_uuid.h"

namespace refit::client {
namespace {

absl::Status Failed(cudaError_t error, const char* what) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error)));
}

}  // namespace

absl::StatusOr<v1::MemoryHandle> CudaMemoryHandle(const void* allocation, uint64_t offset,
                                                  uint64_t size) {
  cudaPointerAttributes attributes{};
  if (const cudaError_t e = cudaPointerGetAttributes(&attributes, allocation); e != cudaSuccess) {
    return Failed(e, "cudaPointerGetAttributes");
  }
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("CudaMemoryHandle needs cudaMalloc'ed device memory");
  }
  const int device = attributes.device;
  cudaDeviceProp properties{};
  if (const cudaError_t e = cudaGetDeviceProperties(&properties, device); e != cudaSuccess) {
    return Failed(e, "cudaGetDeviceProperties");
  }
  // cudaIpcGetMemHandle works on the current device's memory; put the caller's back after.
  int current = 0;
  if (const cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) {
    return Failed(e, "cudaGetDevice");
  }
  cudaIpcMemHandle_t handle;
  cudaError_t error = cudaSetDevice(device);
  if (error == cudaSuccess) error = cudaIpcGetMemHandle(&handle, const_cast<void*>(allocation));
  cudaSetDevice(current);
  if (error != cudaSuccess) return Failed(error, "cudaIpcGetMemHandle");

  cuda::GpuUuid uuid;
  std::memcpy(uuid.data(), properties.uuid.bytes, uuid.size());
  v1::MemoryHandle memory;
  v1::CudaIpc* ipc = memory.mutable_cuda_ipc();
  ipc->set_handle(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ipc->set_device(device);
  ipc->set_device_uuid(cuda::FormatGpuUuid(uuid));
  memory.set_offset(offset);
  memory.set_size(size);
  return memory;
}

}  // namespace refit::client
