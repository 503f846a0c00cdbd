#pragma once

// GPU UUIDs as clients send them in CudaIpc.device_uuid: a device's identity that, unlike its
// ordinal, is the same in every process whatever CUDA_VISIBLE_DEVICES says. The 16 bytes are
// cudaDeviceProp::uuid (what nvidia-smi -L prints, and torch's device properties carry).
// Plain C++, no CUDA: refitd parses at the edge, the CUDA build compares with its devices.
//
// Thread-safe (no state).

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace refit::cuda {

using GpuUuid = std::array<uint8_t, 16>;

// Reads "GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a" as nvidia-smi writes it, with or without the
// "GPU-" prefix, in either case, with the dashes where they go or with none (32 hex digits).
// INVALID_ARGUMENT for anything else (quoting at most 64 bytes of it).
absl::StatusOr<GpuUuid> ParseGpuUuid(const std::string& text);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lowercase: nvidia-smi's form.
std::string FormatGpuUuid(const GpuUuid& uuid);

}  // namespace refit::cuda
