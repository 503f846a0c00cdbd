#pragma once

// Private to daemon/store: fp8 block quantization of a version for the node's fp8 destinations
// with scales (TensorSlice::scale_tensor). A version's bf16 (or any float) pieces are
// quantized once, when the version completes here and before it is visible (the quantizer
// thread in store.cc), into derived slots: one per destination box of a scaled tensor, holding
// its e4m3 bytes and then its FP32 scales. Apply then copies from those slots like from any
// piece, so it stays a copy. The pieces quantized from are the full version held on this node
// (a delta pull has already been applied to them), never a delta.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/plan/plan.h"

namespace refit {

// One box of one scaled destination tensor, as the plan sees it: `fp8` at byte 0 of a derived
// slot and `scales` after it, both row-major, named as the planner's renamed destinations are
// (QuantPlanName), so that the plan copies them into the fp8 slices and the scale tensor.
struct QuantJob {
  std::string key;     // tensor, box and block: equal keys quantize the same bytes
  std::string tensor;  // the source tensor quantized
  std::vector<int64_t> block;
  TensorSlice fp8;
  TensorSlice scales;
  uint64_t bytes = 0;  // of the derived slot
};

// The names the plan uses for a scaled destination slice and for a slice of a scale tensor
// (never a client's tensor name: they start with a NUL byte).
std::string QuantPlanName(const TensorSlice& scaled);
std::string ScalePlanName(const std::string& scale_tensor);

// The jobs for the scaled slices among `slices` (deduplicated, sorted by key).
std::vector<QuantJob> QuantJobsFor(const std::vector<const TensorSlice*>& slices);

// A source piece as the quantizer reads it: host memory with the version's bytes.
struct QuantSource {
  const uint8_t* data = nullptr;  // null: not here
  const std::vector<TensorSlice>* slices = nullptr;
};

// The derived slots of one version, filled once per job key. Thread-safe.
class QuantCache {
 public:
  // The slot of each job, in order, quantizing what is not here yet (over `threads` threads)
  // and waiting for what another caller is quantizing. `values` and `nonfinite_added` get the
  // source values this call quantized and how many of them were inf or NaN. FAILED_PRECONDITION
  // when a source is missing or not a float; the error is kept for that job.
  absl::StatusOr<std::vector<std::shared_ptr<Region>>> Slots(
      const std::vector<QuantSource>& sources, const std::vector<QuantJob>& jobs, SlotPool& pool,
      unsigned threads, uint64_t* nonfinite_added, uint64_t* values);

  // Inf and NaN source values in the blocks quantized so far.
  uint64_t nonfinite() const { return nonfinite_.load(); }

 private:
  struct Entry {
    bool done = false;
    absl::Status status;
    std::shared_ptr<Region> slot;
  };
  common::Mutex mu_;
  common::CondVar done_;
  std::map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> nonfinite_{0};
};

}  // namespace refit
