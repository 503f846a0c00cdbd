#pragma once

// Helpers shared by the --config=cuda implementation files (cuda_runtime.cc,
// cuda_transfer.cc). Internal to //cuda; includes the CUDA runtime API.

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace refit::cuda::internal {

// OK for cudaSuccess; otherwise INTERNAL "what: cudaErrorName (description)". Clears the
// runtime's last error where it is not sticky; a sticky one is remembered for StickyError()
// (cuda.h) and logged, once.
absl::Status CudaStatus(cudaError_t error, const char* what);

// Whether `error` leaves the process's CUDA context unusable (every later call fails with it).
bool IsSticky(cudaError_t error);

// FAILED_PRECONDITION unless `device` is a device this process sees; then makes it the calling
// thread's current device.
absl::Status CheckDevice(int device);

}  // namespace refit::cuda::internal
