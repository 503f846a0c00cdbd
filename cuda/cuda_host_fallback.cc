// The CUDA interface for builds without CUDA: everything that needs a GPU answers "not here",
// clearly; host-to-host copies and plans still work, on the CPU.
#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "cuda/device_uuid.h"
#include "cuda/transfer.h"

namespace refit::cuda {
namespace {

absl::Status NeedsCuda(const std::string& what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, " needs CUDA, and this refitd was built without it (rebuild with --config=cuda)"));
}

}  // namespace

bool CompiledIn() { return false; }

int DeviceCount() { return 0; }

std::string Describe() { return "cuda: not compiled in"; }

absl::StatusOr<int> DeviceByUuid(const std::string& uuid) {
  // Malformed input is INVALID_ARGUMENT here as in the CUDA build.
  auto parsed = ParseGpuUuid(uuid);
  if (!parsed.ok()) return parsed.status();
  return NeedsCuda(absl::StrCat("GPU ", FormatGpuUuid(*parsed)));
}

std::string DeviceUuid(int /*device*/) { return ""; }

absl::Status StickyError() { return absl::OkStatus(); }

absl::StatusOr<std::unique_ptr<Region>> OpenIpc(const std::string& handle, int device,
                                                uint64_t /*offset*/, uint64_t /*size*/) {
  return NeedsCuda(
      absl::StrCat("a CudaIpc handle (", handle.size(), " bytes, device ", device, ")"));
}

absl::StatusOr<std::unique_ptr<Region>> AllocateDevice(uint64_t size, int device) {
  return NeedsCuda(absl::StrCat("a ", size, "-byte slot on cuda device ", device));
}

absl::StatusOr<std::unique_ptr<Region>> AllocatePinnedHost(uint64_t size) {
  return AllocateHost(size);
}

absl::Status Copy(const Region& dst, uint64_t dst_offset, const Region& src, uint64_t src_offset,
                  uint64_t bytes) {
  if (dst.kind() == MemoryKind::kCuda || src.kind() == MemoryKind::kCuda) {
    return NeedsCuda(absl::StrCat("a copy from ", src.Describe(), " to ", dst.Describe()));
  }
  internal::HostMemoryOps ops;
  return internal::CopyWith(ops, dst, dst_offset, src, src_offset, bytes);
}

absl::Status ExecutePlan(const plan::Plan& plan, const std::vector<const Region*>& src,
                         const std::vector<const Region*>& dst) {
  // Refused before anything is written: a plan either runs whole or not at all here.
  for (const auto* regions : {&src, &dst}) {
    for (const Region* region : *regions) {
      if (region != nullptr && region->kind() == MemoryKind::kCuda) {
        return NeedsCuda(absl::StrCat("a plan touching ", region->Describe()));
      }
    }
  }
  internal::HostMemoryOps ops;
  return internal::ExecutePlanWith(ops, plan, src, dst, /*staging_bytes=*/0);
}

absl::StatusOr<uint64_t> QuantizeFp8BlocksOnDevice(const std::vector<cpu::Fp8BlockRun>& runs,
                                                   int device) {
  return NeedsCuda(
      absl::StrCat("fp8 quantization of ", runs.size(), " run(s) on cuda device ", device));
}

absl::StatusOr<std::unique_ptr<RunWriter>> OpenRunWriter(const Region& dst) {
  if (dst.kind() == MemoryKind::kCuda) {
    return NeedsCuda(absl::StrCat("a sparse Apply into ", dst.Describe()));
  }
  return OpenHostRunWriter(dst);
}

}  // namespace refit::cuda
