#pragma once

// The daemon's view of CUDA: whether support is compiled in, which devices it sees, and CUDA
// IPC regions. This header is the same for both builds; `:cuda` picks the implementation:
// the host fallback (no CUDA toolkit needed, every CUDA request answered FAILED_PRECONDITION)
// or, with --config=cuda, the real one.
//
// Thread-safe.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/memory/region.h"

namespace refit::cuda {

// True when this binary was built with --config=cuda.
bool CompiledIn();

// CUDA devices visible to this process; 0 without CUDA or without a GPU.
int DeviceCount();

// "cuda: not compiled in" / "cuda: 13.0, 1 device(s)", for --version and logs.
std::string Describe();

// Opens [offset, offset + size) of the allocation behind a cudaIpcMemHandle_t on `device`.
// FAILED_PRECONDITION where there is no CUDA support or no such device; INVALID_ARGUMENT for a
// malformed handle or a window past the allocation's end.
absl::StatusOr<std::unique_ptr<Region>> OpenIpc(const std::string& handle, int device,
                                                uint64_t offset, uint64_t size);

}  // namespace refit::cuda
