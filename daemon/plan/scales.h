#pragma once

// fp8 destinations with block scales (TensorSlice::scale_tensor / scale_block; the rule is in
// docs/api.md "Engines" and cuda/fp8_block.h): the checks RegisterBuffer makes and the shapes
// the store derives from such a slice. Pure functions, thread-safe.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/types.h"

namespace refit::plan {

// True when the slice asks for block scales (either field set).
bool IsScaled(const TensorSlice& slice);

// Checks a normalized DESTINATION slice that IsScaled: dtype FP8_E4M3, a scale tensor named
// (not the slice's own tensor), one positive block extent per dimension, and a box made of
// whole blocks (every edge on a block boundary or at the tensor's end). INVALID_ARGUMENT
// naming the tensor otherwise.
absl::Status CheckScaledSlice(const TensorSlice& slice);

// NormalizeAndValidateBuffer (plan.h) and, in the same pass over the slices, the checks of each
// slice that IsScaled: refused where the buffer may not hold such slices (`scales_allowed`
// false: a SOURCE buffer; "tensor X: scale_tensor and scale_block are for DESTINATION
// slices"), else CheckScaledSlice. An error of NormalizeAndValidateBuffer wins over these (as
// when the two ran one after the other); among these, the first slice's. `*scaled`: some slice
// IsScaled (set when OK).
absl::Status NormalizeAndValidateScaledBuffer(std::vector<TensorSlice>& slices,
                                              uint64_t region_size, bool scales_allowed,
                                              bool* scaled);

// The scale tensor's global shape: ceil(dim / block) per dimension.
std::vector<int64_t> ScaleShape(const TensorSlice& scaled);

// The box of the scale tensor that holds the scales of `scaled`'s blocks.
void ScaleBox(const TensorSlice& scaled, std::vector<int64_t>* offsets,
              std::vector<int64_t>* sizes);

// Checks a slice of the scale tensor named by `scaled`: FP32, the ScaleShape, not scaled
// itself. INVALID_ARGUMENT otherwise.
absl::Status CheckScaleSlice(const TensorSlice& scaled, const TensorSlice& scale);

}  // namespace refit::plan
