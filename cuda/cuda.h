#pragma once

// The daemon's view of CUDA: whether support is compiled in, which devices it sees, CUDA IPC
// regions, GPU and pinned memory for version slots, and copies and plan execution between any
// host and CUDA memory. This header is the same for both builds and needs no CUDA headers;
// `:cuda` picks the implementation: the host fallback (no CUDA toolkit needed, every request
// that needs a GPU answered FAILED_PRECONDITION, host-only work done on the CPU) or, with
// --config=cuda, the real one (cuda_runtime.cc, cuda_transfer.cc).
//
// Thread-safe: any thread may call anything. Copies and plan execution on one device run on
// that device's own stream (never the legacy default stream) and are serialized per device;
// each call returns only when its bytes are in place. They change the calling thread's current
// CUDA device. Regions returned here own what they hold and release it (close the IPC mapping,
// free the memory) when destroyed; destroy them only when no copy uses them.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/quantize_kernels.h"
#include "cuda/run_writer.h"
#include "daemon/memory/region.h"
#include "daemon/plan/plan.h"

namespace refit::cuda {

// True when this binary was built with --config=cuda.
bool CompiledIn();

// CUDA devices visible to this process; 0 without CUDA, without a driver or without a GPU.
int DeviceCount();

// "cuda: not compiled in" / "cuda: 13.0, 1 device(s), driver 13.0" / "cuda: 13.0, 0 device(s)
// (cudaErrorInsufficientDriver)", for --version and logs.
std::string Describe();

// The ordinal, in this process, of the GPU whose UUID is `uuid` (CudaIpc.device_uuid: any form
// ParseGpuUuid in device_uuid.h reads, e.g. "GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a"). Clients
// send UUIDs because their ordinals are not refitd's under CUDA_VISIBLE_DEVICES.
// INVALID_ARGUMENT for a malformed UUID; FAILED_PRECONDITION where there is no CUDA support or
// this node has no GPU with that UUID (the message lists the ones it has).
absl::StatusOr<int> DeviceByUuid(const std::string& uuid);

// nvidia-smi's form of device `device`'s UUID; empty without CUDA or without that device.
std::string DeviceUuid(int device);

// OK until this process meets a sticky CUDA error (cudaErrorIllegalAddress, a launch failure, an
// uncorrectable ECC error...): from then on, the first such error, for good. Every later CUDA
// call of the process fails the same way, so refitd reports NOT_SERVING and must be restarted.
// Always OK without CUDA support.
absl::Status StickyError();

// Opens [offset, offset + size) of the allocation behind a cudaIpcMemHandle_t (the raw 64 bytes,
// as CudaIpc.handle carries them) on `device`; `size` 0 means "to the end of the allocation".
// The region is kind kCuda on `device`. Opening the same handle again (another window of one
// allocation) shares one mapping, closed when its last region goes. FAILED_PRECONDITION where
// there is no CUDA support or no such device; INVALID_ARGUMENT for a malformed or stale handle,
// a handle exported by this very process, or a window past the allocation's end.
absl::StatusOr<std::unique_ptr<Region>> OpenIpc(const std::string& handle, int device,
                                                uint64_t offset, uint64_t size);

// `size` bytes of memory on `device` (cudaMalloc; not zeroed), e.g. a GPU version slot.
// FAILED_PRECONDITION without CUDA support or without that device; RESOURCE_EXHAUSTED when the
// device has no room.
absl::StatusOr<std::unique_ptr<Region>> AllocateDevice(uint64_t size, int device);

// `size` bytes of page-locked host memory (cudaHostAlloc, usable by every device), e.g. a host
// version slot that GPUs copy from and to at full speed. Kind kHost. Without CUDA support (or
// without a device) it is AllocateHost(size): ordinary pre-faulted host memory.
absl::StatusOr<std::unique_ptr<Region>> AllocatePinnedHost(uint64_t size);

// Copies `bytes` from src[src_offset ..] to dst[dst_offset ..] for any pair of host and CUDA
// regions, on the same or different devices; the two windows must not overlap. Returns when the
// bytes are in place. Host memory that is not pinned is staged through pinned buffers in
// chunks. INVALID_ARGUMENT for a window past a region's end; FAILED_PRECONDITION when a region is
// CUDA memory and this build has no CUDA support; INTERNAL for a CUDA error.
absl::Status Copy(const Region& dst, uint64_t dst_offset, const Region& src, uint64_t src_offset,
                  uint64_t bytes);

// plan::ExecuteOnHost for regions of any kind: src[i] / dst[i] is the region of location i.
// Converts dtypes where an op asks for it (on the GPU: the same bytes as on the CPU). Ops
// between host regions run on the CPU (plan::ExecuteOnHost); ops that touch CUDA memory run as
// copies and kernels, staging through scratch where an op crosses between host and device and
// converts or is strided. Returns when every op is done. INVALID_ARGUMENT for an op outside its
// regions; FAILED_PRECONDITION when an op touches CUDA memory and this build has no CUDA
// support; INTERNAL for a CUDA error (the destinations are then partly written).
absl::Status ExecutePlan(const plan::Plan& plan, const std::vector<const Region*>& src,
                         const std::vector<const Region*>& dst);

// cpu::QuantizeFp8Blocks (quantize_kernels.h) for runs in GPU memory: each run's `src`, `dst` and
// `scales` point into CUDA memory of `device` (`scale_row_of` stays in host memory; it is
// copied up, once per distinct array). Runs them in order on the device's stream with the GPU
// kernel (gpu_quantize.h, bit-identical to the CPU kernels) and returns, once every byte is
// written, how many source elements were inf or NaN. INVALID_ARGUMENT for what the CPU version
// refuses (a non-float dtype, a zero block, a scale row out of range); FAILED_PRECONDITION
// without CUDA support or without that device; INTERNAL for a CUDA error (the outputs are then
// partly written).
absl::StatusOr<uint64_t> QuantizeFp8BlocksOnDevice(const std::vector<cpu::Fp8BlockRun>& runs,
                                                   int device);

// A sparse Apply's writer for the destination region `dst` (run_writer.h): for CUDA memory, runs
// and values uploaded to device scratch, gpu::ScatterRuns / gpu::GatherRuns on the device's
// stream (the device's context locked for each call, as Copy does); for host memory, the host
// writer (the CPU twins). FAILED_PRECONDITION for CUDA memory without CUDA support.
absl::StatusOr<std::unique_ptr<RunWriter>> OpenRunWriter(const Region& dst);

}  // namespace refit::cuda
