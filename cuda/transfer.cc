#include "cuda/transfer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda::internal {
namespace {

// One past the last byte a side of an op touches, relative to its offset. Strides in plans are
// non-negative; 128-bit arithmetic so that a forged op can't wrap around.
unsigned __int128 SideExtent(uint64_t count, uint64_t rows, int64_t stride, int64_t row_stride,
                             uint64_t element_size) {
  const unsigned __int128 last =
      static_cast<unsigned __int128>(rows - 1) * static_cast<uint64_t>(row_stride) +
      static_cast<unsigned __int128>(count - 1) * static_cast<uint64_t>(stride);
  return (last + 1) * element_size;
}

absl::Status CheckSide(const Region& region, uint64_t offset, unsigned __int128 extent,
                       const char* what, size_t op_index) {
  if (static_cast<unsigned __int128>(offset) + extent > region.size()) {
    return absl::InvalidArgumentError(absl::StrCat("copy op ", op_index, " reaches past its ", what,
                                                   " region (", region.Describe(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckOp(const plan::CopyOp& op, size_t index, const std::vector<const Region*>& src,
                     const std::vector<const Region*>& dst) {
  if (op.src_location >= src.size() || src[op.src_location] == nullptr ||
      op.dst_location >= dst.size() || dst[op.dst_location] == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy op ", index, " names a location without a region"));
  }
  if (op.count == 0 || op.rows == 0) return absl::OkStatus();
  if (op.src_stride < 0 || op.dst_stride < 0 || op.src_row_stride < 0 || op.dst_row_stride < 0) {
    return absl::InvalidArgumentError(absl::StrCat("copy op ", index, " has a negative stride"));
  }
  const uint64_t es = DTypeSize(op.src_dtype), ed = DTypeSize(op.dst_dtype);
  if (es == 0 || ed == 0) {
    return absl::InvalidArgumentError(absl::StrCat("copy op ", index, " has an unknown dtype"));
  }
  RETURN_IF_ERROR(CheckSide(*src[op.src_location], op.src_offset,
                            SideExtent(op.count, op.rows, op.src_stride, op.src_row_stride, es),
                            "source", index));
  return CheckSide(*dst[op.dst_location], op.dst_offset,
                   SideExtent(op.count, op.rows, op.dst_stride, op.dst_row_stride, ed),
                   "destination", index);
}

// Runs one op whose sides are in different places, or in one device.
absl::Status RunOp(DeviceOps& ops, const plan::CopyOp& op, Place sp, const uint8_t* s, Place dp,
                   uint8_t* d, uint64_t staging_bytes) {
  const int64_t es = static_cast<int64_t>(DTypeSize(op.src_dtype));
  const int64_t ed = static_cast<int64_t>(DTypeSize(op.dst_dtype));
  if (sp == dp) {
    return ops.Convert(
        sp, s, op.src_dtype, d, op.dst_dtype,
        {op.count, op.rows, op.src_stride, op.dst_stride, op.src_row_stride, op.dst_row_stride});
  }
  const bool same = op.src_dtype == op.dst_dtype;
  const uint64_t row_bytes = op.count * static_cast<uint64_t>(ed);
  if (same && op.src_stride == 1 && op.dst_stride == 1) {
    // The common case: rows of bytes, whatever the pitches; the copy engines do it all.
    return ops.Copy2D(dp, d, static_cast<uint64_t>(op.dst_row_stride * ed), sp, s,
                      static_cast<uint64_t>(op.src_row_stride * es), row_bytes, op.rows);
  }
  // Staged, piece by piece: at most `per_piece` elements, whole rows where they fit.
  const uint64_t per_piece = std::max<uint64_t>(1, staging_bytes / static_cast<uint64_t>(ed));
  const uint64_t piece_columns = std::min(op.count, per_piece);
  const uint64_t piece_rows = std::max<uint64_t>(1, std::min(op.rows, per_piece / op.count));
  for (uint64_t r0 = 0; r0 < op.rows; r0 += piece_rows) {
    const uint64_t nr = std::min(piece_rows, op.rows - r0);
    for (uint64_t c0 = 0; c0 < op.count; c0 += piece_columns) {
      const uint64_t nc = std::min(piece_columns, op.count - c0);
      const int64_t r = static_cast<int64_t>(r0), c = static_cast<int64_t>(c0);
      const int64_t packed_columns = static_cast<int64_t>(nc);
      const uint64_t packed_pitch = nc * static_cast<uint64_t>(ed);
      const uint8_t* src_piece = s + (r * op.src_row_stride + c * op.src_stride) * es;
      uint8_t* dst_piece = d + (r * op.dst_row_stride + c * op.dst_stride) * ed;
      // 1. On the source's side: gather and convert into dense rows, unless they already are.
      const uint8_t* moved = src_piece;
      uint64_t moved_pitch = static_cast<uint64_t>(op.src_row_stride * es);
      if (!same || op.src_stride != 1) {
        ASSIGN_OR_RETURN(uint8_t * packed, ops.Scratch(sp, 0, nr * packed_pitch));
        RETURN_IF_ERROR(ops.Convert(sp, src_piece, op.src_dtype, packed, op.dst_dtype,
                                    {nc, nr, op.src_stride, 1, op.src_row_stride, packed_columns}));
        // The move below may run on the other place's stream.
        RETURN_IF_ERROR(ops.Synchronize());
        moved = packed;
        moved_pitch = packed_pitch;
      }
      // 2. Across: straight into the destination when its rows are dense, else into scratch
      // that the destination's side 3. scatters into its strides.
      if (op.dst_stride == 1) {
        RETURN_IF_ERROR(ops.Copy2D(dp, dst_piece, static_cast<uint64_t>(op.dst_row_stride * ed), sp,
                                   moved, moved_pitch, packed_pitch, nr));
      } else {
        ASSIGN_OR_RETURN(uint8_t * landed, ops.Scratch(dp, 1, nr * packed_pitch));
        RETURN_IF_ERROR(
            ops.Copy2D(dp, landed, packed_pitch, sp, moved, moved_pitch, packed_pitch, nr));
        // A copy into host scratch is queued on the source device's stream, and the host
        // scatters at once: it must wait for the bytes to land. (Into a device, the scatter is
        // queued behind the copy on the same stream.)
        if (dp == kHost) RETURN_IF_ERROR(ops.Synchronize());
        RETURN_IF_ERROR(ops.Convert(dp, landed, op.dst_dtype, dst_piece, op.dst_dtype,
                                    {nc, nr, 1, op.dst_stride, packed_columns, op.dst_row_stride}));
      }
      // The scratch buffers are reused by the next piece.
      RETURN_IF_ERROR(ops.Synchronize());
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWindow(const Region& region, uint64_t offset, uint64_t bytes, const char* what) {
  if (offset > region.size() || bytes > region.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat("copy of ", bytes, " bytes at offset ", offset,
                                                   " does not fit the ", what, " region (",
                                                   region.Describe(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CopyWith(DeviceOps& ops, const Region& dst, uint64_t dst_offset, const Region& src,
                      uint64_t src_offset, uint64_t bytes) {
  RETURN_IF_ERROR(CheckWindow(dst, dst_offset, bytes, "destination"));
  RETURN_IF_ERROR(CheckWindow(src, src_offset, bytes, "source"));
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(ops.Copy2D(PlaceOf(dst), dst.data() + dst_offset, bytes, PlaceOf(src),
                             src.data() + src_offset, bytes, bytes, 1));
  return ops.Synchronize();
}

absl::Status ExecutePlanWith(DeviceOps& ops, const plan::Plan& plan,
                             const std::vector<const Region*>& src,
                             const std::vector<const Region*>& dst, uint64_t staging_bytes) {
  for (size_t i = 0; i < plan.ops.size(); ++i) RETURN_IF_ERROR(CheckOp(plan.ops[i], i, src, dst));
  // Host-to-host ops keep plan::ExecuteOnHost's tuned paths (row groups, streaming stores).
  plan::Plan host_plan;
  for (const plan::CopyOp& op : plan.ops) {
    if (op.count == 0 || op.rows == 0) continue;
    const Region& s = *src[op.src_location];
    const Region& d = *dst[op.dst_location];
    const Place sp = PlaceOf(s), dp = PlaceOf(d);
    if (sp == kHost && dp == kHost) {
      host_plan.ops.push_back(op);
      continue;
    }
    const absl::Status status =
        RunOp(ops, op, sp, s.data() + op.src_offset, dp, d.data() + op.dst_offset, staging_bytes);
    if (!status.ok()) {
      (void)ops.Synchronize();  // nothing queued may outlive the call
      return status;
    }
  }
  if (!host_plan.ops.empty()) {
    std::vector<const uint8_t*> host_src;
    std::vector<uint8_t*> host_dst;
    for (const Region* region : src) host_src.push_back(region ? region->data() : nullptr);
    for (const Region* region : dst) host_dst.push_back(region ? region->data() : nullptr);
    plan::ExecuteOnHost(host_plan, host_src, host_dst);
  }
  return ops.Synchronize();
}

absl::Status HostMemoryOps::Convert(Place /*place*/, const uint8_t* src, DType src_dtype,
                                    uint8_t* dst, DType dst_dtype, const ElementRun& run) {
  ++converts_;
  return cpu::Convert(src, src_dtype, dst, dst_dtype, run);
}

absl::Status HostMemoryOps::Copy2D(Place dst_place, uint8_t* dst, uint64_t dst_pitch,
                                   Place src_place, const uint8_t* src, uint64_t src_pitch,
                                   uint64_t row_bytes, uint64_t rows) {
  if (dst_place != src_place) ++cross_place_copies_;
  cpu::Copy2D(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> HostMemoryOps::Scratch(Place place, int slot, uint64_t bytes) {
  std::vector<uint8_t>& buffer = scratch_[{place, slot}];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

}  // namespace refit::cuda::internal
