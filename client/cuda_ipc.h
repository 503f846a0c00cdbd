#pragma once

// For C++ trainers and engines whose tensors live in CUDA memory: the MemoryHandle that lends
// refitd a window of a cudaMalloc allocation, with the allocation's IPC handle and its GPU named
// by UUID (read from the CUDA runtime), so that refitd opens it on the right device whatever
// CUDA_VISIBLE_DEVICES says in either process. Put the result in
// RegisterBufferRequest.memory.
//
// Needs the CUDA runtime: the target //client:refit_client_cuda builds only with
// --config=cuda. Thread-safe; changes no current device.

#include <cstdint>

#include "absl/status/statusor.h"
#include "proto/refit/v1/refit.pb.h"

namespace refit::client {

// [offset, offset + size) of the allocation that cudaMalloc returned as `allocation` (size 0:
// to its end). The allocation must stay alive while the buffer is registered. INVALID_ARGUMENT
// when `allocation` is not CUDA device memory; INTERNAL for another CUDA error.
absl::StatusOr<v1::MemoryHandle> CudaMemoryHandle(const void* allocation, uint64_t offset = 0,
                                                  uint64_t size = 0);

}  // namespace refit::client
