#pragma once

// How cuda::Copy and cuda::ExecutePlan move bytes between host and CUDA memory, written against
// a small interface (DeviceOps) so that the logic — bounds checks, which side converts, staging
// through scratch buffers, splitting big ops — is plain C++ that runs and is tested without a
// GPU (transfer_test drives it with host memory posing as devices). cuda_runtime.cc implements
// DeviceOps with CUDA streams; the host fallback with host memory only.
//
// Internal to //cuda. A DeviceOps object belongs to one call on one thread.

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/kernels.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/plan/plan.h"

namespace refit::cuda::internal {

// Where bytes live: the host, or a CUDA device ordinal.
using Place = int;
inline constexpr Place kHost = -1;

inline Place PlaceOf(const Region& region) {
  return region.kind() == MemoryKind::kCuda ? region.device() : kHost;
}

// The primitives. Work that touches a device may be queued on that device's stream and run
// later, in call order per stream but in no particular order across streams: Convert on its
// place's stream, Copy2D on the destination's (the source's when the destination is the host).
// Work on the host alone is done when the call returns. Nothing queued is known to have
// happened, its bytes included, until Synchronize() returns, which waits for all of it.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  // Converts (or copies, for one dtype) a run whose source and destination are both in `place`.
  virtual absl::Status Convert(Place place, const uint8_t* src, DType src_dtype, uint8_t* dst,
                               DType dst_dtype, const ElementRun& run) = 0;

  // Copies `rows` rows of `row_bytes` between any two places (as cpu::Copy2D).
  virtual absl::Status Copy2D(Place dst_place, uint8_t* dst, uint64_t dst_pitch, Place src_place,
                              const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
                              uint64_t rows) = 0;

  // At least `bytes` of scratch memory in `place` (host scratch should be pinned); `slot` 0 or
  // 1 names one of two buffers per place, valid until the next call for that place and slot.
  virtual absl::StatusOr<uint8_t*> Scratch(Place place, int slot, uint64_t bytes) = 0;

  // Waits for all queued work; reports the first error of any of it.
  virtual absl::Status Synchronize() = 0;
};

// DeviceOps for memory the CPU can address in every place: the host fallback (after checking
// that no region is CUDA memory) and transfer_test (where "devices" are host memory). Runs the
// CPU kernels; counts what it was asked to do, so tests can see how a plan was executed.
class HostMemoryOps final : public DeviceOps {
 public:
  absl::Status Convert(Place place, const uint8_t* src, DType src_dtype, uint8_t* dst,
                       DType dst_dtype, const ElementRun& run) override;
  absl::Status Copy2D(Place dst_place, uint8_t* dst, uint64_t dst_pitch, Place src_place,
                      const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
                      uint64_t rows) override;
  absl::StatusOr<uint8_t*> Scratch(Place place, int slot, uint64_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

  uint64_t converts() const { return converts_; }
  uint64_t cross_place_copies() const { return cross_place_copies_; }

 private:
  std::map<std::pair<Place, int>, std::vector<uint8_t>> scratch_;
  uint64_t converts_ = 0;
  uint64_t cross_place_copies_ = 0;
};

// INVALID_ARGUMENT unless [offset, offset + bytes) lies inside `region`; `what` names the side.
absl::Status CheckWindow(const Region& region, uint64_t offset, uint64_t bytes, const char* what);

// cuda::Copy over `ops`: bounds checks, then one Copy2D row, synchronized.
absl::Status CopyWith(DeviceOps& ops, const Region& dst, uint64_t dst_offset, const Region& src,
                      uint64_t src_offset, uint64_t bytes);

// cuda::ExecutePlan over `ops`. Ops whose source and destination are both host memory go to
// plan::ExecuteOnHost; ops within one place to ops.Convert; same-dtype ops with contiguous rows
// between places to ops.Copy2D. Anything else (a conversion or a strided side across places)
// is staged: the source place gathers and converts into dense scratch, which moves to the
// destination place, which scatters it into its strides. Ops are split so that a stage holds
// at most `staging_bytes`. INVALID_ARGUMENT for an op outside its region or a location without
// a region; returns after everything is written.
absl::Status ExecutePlanWith(DeviceOps& ops, const plan::Plan& plan,
                             const std::vector<const Region*>& src,
                             const std::vector<const Region*>& dst, uint64_t staging_bytes);

}  // namespace refit::cuda::internal
