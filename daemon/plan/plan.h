#pragma once

// Transfer plans: pure functions from source layouts x destination layouts to a list of copy
// operations. No I/O, no protobuf. Owned by nobody: every function here is thread-safe.
//
// A "location" is an index the caller chooses: for sources, one snapshot piece of a version
// (one published SOURCE buffer, possibly on another node); for destinations, one DESTINATION
// buffer. Offsets in a plan are bytes from the start of that location's memory.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/types.h"

namespace refit::plan {

// Fills in empty `offsets` (zeros), `sizes` (whole tensor) and `buffer_strides` (row-major) and
// checks one buffer's slices against a region of `region_size` bytes: known dtype, positive
// global shape, matching ranks, slice inside the tensor, every element inside the region, no
// two slices of the buffer sharing a byte. INVALID_ARGUMENT naming the slice otherwise.
absl::Status NormalizeAndValidateBuffer(std::vector<TensorSlice>& slices, uint64_t region_size);

// [first byte, one past last byte) that a normalized slice touches in its buffer.
std::pair<uint64_t, uint64_t> SliceByteExtent(const TensorSlice& slice);

// A normalized slice living in one location.
struct PlacedSlice {
  const TensorSlice* slice = nullptr;  // not owned; must outlive the BuildPlan call
  uint32_t location = 0;
  uint32_t node = 0;  // the daemon holding the location; replicated sources are spread by node
};

// Copy `count` elements: source element i is at src_offset + i * src_stride * size(src_dtype),
// destination element i at dst_offset + i * dst_stride * size(dst_dtype). The dtypes differ
// when the destination asks for a conversion.
//
// Addition: an op may repeat that run `rows` times (only in plans built with
// PlanOptions::multi_row_ops; otherwise rows is always 1): element i of row r is at
// src_offset + (r * src_row_stride + i * src_stride) * size(src_dtype), and likewise for the
// destination. Strides in a plan are always positive.
struct CopyOp {
  uint32_t src_location = 0;
  uint64_t src_offset = 0;
  uint32_t dst_location = 0;
  uint64_t dst_offset = 0;
  uint64_t count = 0;
  int64_t src_stride = 1;
  int64_t dst_stride = 1;
  DType src_dtype = DType::kUnspecified;
  DType dst_dtype = DType::kUnspecified;
  uint64_t rows = 1;
  int64_t src_row_stride = 0;  // elements of src_dtype; unused when rows == 1
  int64_t dst_row_stride = 0;  // elements of dst_dtype; unused when rows == 1

  bool operator==(const CopyOp& other) const;
};

struct Plan {
  std::vector<CopyOp> ops;  // deterministic order; contiguous runs coalesced
  uint64_t src_bytes = 0;   // bytes read from sources: what a remote pull moves
  uint64_t dst_bytes = 0;   // bytes written into destinations
};

// Builds the plan that fills every element of every destination slice exactly once from the
// sources. Source slices of one tensor must agree on dtype and global shape, and a destination
// slice's global shape must equal its tensor's: INVALID_ARGUMENT otherwise. A destination
// element that no source covers: FAILED_PRECONDITION naming the tensor and the missing box.
// Deterministic: the same inputs give the same plan.
absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations);

// Addition: knobs for BuildPlan. The two-argument BuildPlan uses the defaults.
struct PlanOptions {
  // Emit two-dimensional ops (CopyOp::rows > 1) where a box has more than one run. A row-parallel
  // TP8 -> TP2 reshard of a 70B model is ~10M single-row ops but ~1k multi-row ops.
  bool multi_row_ops = false;
  // Sources held by this node are preferred over replicas elsewhere (a local copy moves nothing
  // over the network). Without it, replicated sources are spread by bytes taken from each node.
  std::optional<uint32_t> local_node;
};
absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations,
                               const PlanOptions& options);

// Addition: a destination slice and the one source slice the caller matched to it, which holds
// every element of it (names are not compared: the caller knows they are the same tensor).
struct SlicePair {
  PlacedSlice source;
  PlacedSlice destination;
};
// BuildPlan(sources, destinations, options), then the ops of each of `pairs` after those (no
// name lookups, no choice among replicas: what fills many destinations one for one, such as a
// node's quantized fp8 slots, costs one op each). A pair whose source does not hold the whole
// destination, or whose ranks or dtypes don't go together: INVALID_ARGUMENT.
absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations,
                               const PlanOptions& options, const std::vector<SlicePair>& pairs);

// Runs `plan` on host memory: `src[i]` / `dst[i]` is the base address of location i. Converts
// dtypes where an op asks for it. The caller guarantees every op lies inside its locations.
void ExecuteOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                   const std::vector<uint8_t*>& dst);

// Verified install: runs `plan` like ExecuteOnHost and checks each piece of work right after
// it ran, while its bytes are still in cache: what landed in the destinations is compared with
// what the plan says they must hold (the source bytes, converted where an op converts).
// Returns the indices of the ops whose destination bytes differ, ascending (empty: everything
// landed as planned).
std::vector<size_t> ExecuteAndVerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                           const std::vector<uint8_t*>& dst);

// Verified install with the undo save folded into the copy: as ExecuteAndVerifyOnHost, and
// right before each piece of work (256 KiB) overwrites destination bytes, those bytes are copied
// (streaming stores) to `saved`, SavedBytes(plan) bytes in all, in plan order: the ops of a row
// group (a row-split tensor gathered side by side) row by row as each row lies in the
// destination, any other op's elements row by row. The save's read of each destination line is the
// read that ordinary stores (write-allocate) and the check need anyway, so a store that saves what
// an Apply overwrites gets the verified copy without a second read of the destination.
// ExecuteOnHost(RestorePlan(plan), {saved}, dst) puts the destinations back as they were.
// `marks` (may be null): SaveTasks(plan) bytes, zero on entry; piece k's byte is set to 1 once
// its bytes are saved (their streaming stores fenced) and before its first write, on the thread
// that writes it. A process killed part-way (memory shared with a file keeps every store made)
// leaves the marked pieces restorable: RestorePlan(plan, marks); unmarked ones were not written.
std::vector<size_t> ExecuteSaveAndVerifyOnHost(const Plan& plan,
                                               const std::vector<const uint8_t*>& src,
                                               const std::vector<uint8_t*>& dst, uint8_t* saved,
                                               uint8_t* marks = nullptr);

// Bytes ExecuteSaveAndVerifyOnHost saves for `plan`: every destination element it writes.
uint64_t SavedBytes(const Plan& plan);

// Pieces of work ExecuteSaveAndVerifyOnHost cuts `plan` into: the bytes of its `marks`.
uint64_t SaveTasks(const Plan& plan);

// The plan that copies what ExecuteSaveAndVerifyOnHost saved (location 0) back into the
// destinations of `plan`, at the same places, bytes unconverted: every piece (marks null) or
// the pieces whose mark is nonzero. `pieces` (may be null): per op of the result, the piece
// (index into `marks`) it restores; the result is then cut by pieces even without `marks`.
Plan RestorePlan(const Plan& plan, const uint8_t* marks = nullptr,
                 std::vector<uint32_t>* pieces = nullptr);

// Only the check (refitctl verify): the ops whose destination bytes differ from what `plan`
// would write there from `src`.
std::vector<size_t> VerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                 const std::vector<uint8_t*>& dst);

}  // namespace refit::plan
