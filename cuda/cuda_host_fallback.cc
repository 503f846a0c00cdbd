// The CUDA interface for builds without CUDA: everything answers "not here", clearly.
#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"

namespace refit::cuda {

bool CompiledIn() { return false; }

int DeviceCount() { return 0; }

std::string Describe() { return "cuda: not compiled in"; }

absl::StatusOr<std::unique_ptr<Region>> OpenIpc(const std::string& handle, int device,
                                                uint64_t /*offset*/, uint64_t /*size*/) {
  return absl::FailedPreconditionError(absl::StrCat(
      "a CudaIpc handle (", handle.size(), " bytes, device ", device,
      ") needs CUDA, and this refitd was built without it (rebuild with --config=cuda)"));
}

}  // namespace refit::cuda
