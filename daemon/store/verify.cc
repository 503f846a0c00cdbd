// Verified install, the comparisons (verify.h).

#include "daemon/store/verify.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"

namespace refit {
namespace {

// True when the element at byte `offset` of a buffer belongs to `slice` (normalized: sizes and
// element strides per dimension, outer dimensions first).
bool SliceHolds(const TensorSlice& slice, uint64_t offset) {
  if (offset < slice.buffer_offset) return false;
  const uint64_t elem = DTypeSize(slice.dtype);
  uint64_t rel = offset - slice.buffer_offset;
  if (elem == 0 || rel % elem != 0) return false;
  rel /= elem;
  for (size_t d = 0; d < slice.sizes.size(); ++d) {
    const uint64_t stride =
        d < slice.buffer_strides.size() ? static_cast<uint64_t>(slice.buffer_strides[d]) : 1;
    const uint64_t index = stride == 0 ? 0 : rel / stride;
    if (index >= static_cast<uint64_t>(slice.sizes[d])) return false;
    rel -= index * stride;
  }
  return rel == 0;
}

}  // namespace

std::map<std::string, std::vector<std::string>> TensorsOfOps(
    const plan::Plan& plan, const std::vector<size_t>& bad,
    const std::vector<VerifyTarget>& dests) {
  std::map<std::string, std::vector<std::string>> tensors;
  for (size_t i : bad) {
    const plan::CopyOp& op = plan.ops[i];
    if (op.dst_location >= dests.size()) continue;
    const VerifyTarget& dest = dests[op.dst_location];
    std::string name = absl::StrCat("bytes at offset ", op.dst_offset);
    if (dest.slices) {
      for (const TensorSlice& slice : *dest.slices) {
        if (SliceHolds(slice, op.dst_offset)) {
          name = slice.name;
          break;
        }
      }
    }
    std::vector<std::string>& names = tensors[dest.id];
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return tensors;
}

void Verifier::Compare(const plan::Plan& plan, const std::vector<const uint8_t*>& sources,
                       const VerifyTarget& dest, uint8_t* bytes, VerifyResult* result) {
  const std::vector<size_t> bad = plan::VerifyOnHost(plan, sources, {bytes});
  result->checked = true;
  if (bad.empty()) return;
  auto tensors = TensorsOfOps(plan, bad, {dest});
  result->stale_tensors = tensors[dest.id];
  failures_.push_back(absl::StrCat("buffer ", dest.id, " (version ", result->version,
                                   "): ", absl::StrJoin(result->stale_tensors, ", ")));
}

void Verifier::Released(const absl::Status& held, const absl::Status& released,
                        VerifyResult* result) {
  if (released.ok()) {
    result->checked = true;
  } else if (released.code() == absl::StatusCode::kDataLoss) {
    result->checked = true;
    result->stale_tensors.push_back(std::string(released.message()));
    failures_.push_back(std::string(released.message()));
  } else {
    result->note = std::string(held.message());
  }
}

absl::StatusOr<std::vector<VerifyResult>> Verifier::Finish(
    std::vector<VerifyResult> results) const {
  if (failures_.empty()) return results;
  const std::string message =
      absl::StrCat("model ", model_, ": destination bytes differ from the version they hold: ",
                   absl::StrJoin(failures_, "; "), " (written by someone else since that Apply?)");
  Logger("store")->warn("{}", message);
  return absl::DataLossError(message);
}

}  // namespace refit
