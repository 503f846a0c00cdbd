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
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/plan/plan.h"

namespace refit {

struct ChangeList;  // store_internal.h

// Sparse Apply into fp8 destinations (store_sparse.cc, Store::DiffDerived): what a version's
// derived slot of one batch changed against another version's slot of the same batch.
struct DerivedChanges {
  std::shared_ptr<const ChangeList> list;  // null: not diffed
  uint64_t base = 0;                       // the version diffed against
  uint64_t compared = 0;                   // bytes of the slot compared
};

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
  // Where the layout the batch was made from holds the tensor in one slice only, and that slice
  // holds the whole box: its piece and its index in the piece's slices (what Apply reads of the
  // sources for this job, without a plan to choose among replicas); else kNoSource.
  static constexpr uint32_t kNoSource = ~uint32_t{0};
  uint32_t only_piece = kNoSource;
  uint32_t only_index = 0;
};

// The names the plan uses for a scaled destination slice and for a slice of a scale tensor
// (never a client's tensor name: they start with a NUL byte).
std::string QuantPlanName(const TensorSlice& scaled);
std::string ScalePlanName(const std::string& scale_tensor);

// The jobs for the scaled slices among `slices` (deduplicated, sorted by key); with
// `job_of_slice`, the index of each slice's job (kNoJob for a slice without scales).
inline constexpr size_t kNoJob = ~size_t{0};
std::vector<QuantJob> QuantJobsFor(const std::vector<const TensorSlice*>& slices,
                                   std::vector<size_t>* job_of_slice = nullptr);

// A source piece as the quantizer reads it: memory with the version's bytes (host memory, or a
// GPU slot for QuantCache::Run on a device).
struct QuantSource {
  const uint8_t* data = nullptr;   // null: not here (yet)
  const Region* region = nullptr;  // what `data` points into (gathers on a device need it)
  const std::vector<TensorSlice>* slices = nullptr;
  // The bytes of `data` that have landed ([begin, end), sorted, disjoint; a pull in progress);
  // null: all of them.
  const std::vector<std::pair<uint64_t, uint64_t>>* landed = nullptr;
};

// A set of jobs worked out once against one source layout (the slices of a version's pieces)
// and run for every version of that layout: each band of each job (one block of dimension 0)
// knows where its rows lie in a piece (or the plan that gathers them), and where its fp8 bytes
// and scales go in the one slot all the jobs share. Bands are grouped into tasks of a few MiB
// of source read from one piece, so 100,000 small tensors cost a few hundred tasks, not
// 100,000 lookups, slots and allocations per version. Immutable once made.
class QuantBatch {
 public:
  // The jobs of the scaled slices among `slices` (QuantJobsFor), read from a layout whose
  // pieces hold `pieces` (the slices of each, in order).
  static std::shared_ptr<const QuantBatch> Make(
      const std::vector<const TensorSlice*>& slices,
      const std::vector<const std::vector<TensorSlice>*>& pieces);

  // The jobs, their fp8 and scale slices placed in the batch's slot (buffer_offset).
  const std::vector<QuantJob>& jobs() const { return jobs_; }
  // The job of `key`, or null.
  const QuantJob* Find(const std::string& key) const;
  // The job of one of the slices the batch was made from (by address), or null.
  const QuantJob* JobOf(const TensorSlice* scaled) const;
  uint64_t bytes() const { return bytes_; }  // of the slot

  struct Band {
    uint32_t job = 0;
    // Where its rows lie as evenly strided rows of one piece (the first of these whose piece is
    // here is read); none: gathered by `gather`.
    struct Direct {
      uint32_t piece = 0;
      uint64_t offset = 0;  // bytes into the piece
      int64_t row_stride = 0;
    };
    std::vector<Direct> direct;
    DType dtype = DType::kUnspecified;
    uint64_t rows = 0;
    const uint32_t* map = nullptr;  // `rows` scale rows (owned by the batch)
    uint64_t scale_rows = 0;
    uint64_t cols = 0;
    uint64_t block_cols = 0;
    uint64_t dst_offset = 0;     // of its first fp8 byte in the slot
    uint64_t scales_offset = 0;  // of its first scale in the slot
    std::shared_ptr<const plan::Plan> gather;
    std::vector<uint32_t> gather_pieces;  // the pieces `gather` reads
  };
  // Bytes [begin, end) of a piece that a task reads.
  struct Extent {
    uint32_t piece = 0;
    uint64_t begin = 0;
    uint64_t end = 0;
  };
  struct Task {
    size_t first_band = 0;
    size_t end_band = 0;
    std::vector<uint32_t> pieces;  // read by its bands: all must be here to run it
    std::vector<Extent> extents;   // and these bytes of them landed
  };
  const std::vector<Band>& bands() const { return bands_; }
  const std::vector<Task>& tasks() const { return tasks_; }
  // Why a job cannot be quantized from this layout (no source, not a float, no gather); OK.
  const absl::Status& job_error(size_t job) const { return job_errors_[job]; }

 private:
  std::vector<QuantJob> jobs_;
  std::unordered_map<std::string, uint32_t> by_key_;
  std::unordered_map<const TensorSlice*, uint32_t> by_slice_;
  std::vector<absl::Status> job_errors_;
  std::vector<Band> bands_;
  std::vector<Task> tasks_;
  std::map<std::string, std::vector<uint32_t>> maps_;  // row maps shared by equal geometries
  uint64_t bytes_ = 0;
};

// The derived slots of one version, one per batch, filled once. Thread-safe.
class QuantCache {
 public:
  // Runs the tasks of `batch` not run yet for this version, over `threads` threads. With
  // `partial`, only those whose pieces are all here (sources[p].data set) and it returns a null
  // slot while some are left (the version's pieces are still arriving); otherwise every task
  // runs and it returns the slot. A second caller waits for the first. `values` and
  // `nonfinite_added`: the source values this call quantized and how many of them were inf or
  // NaN. FAILED_PRECONDITION when a source is missing or not a float; the error is kept.
  // `device` kOnHost: the sources are host memory, `pool` makes host slots, and the CPU kernel
  // runs on `threads` threads; a CUDA ordinal: the sources are GPU slots on that device, `pool`
  // makes GPU slots, and every band runs on the GPU (cuda::QuantizeFp8BlocksOnDevice: the same
  // bytes), task by task on the calling thread. With `partial`, `max_tasks` bounds the tasks
  // this call runs (a caller that must not hold the CPU long: the landed-bytes quantizer), and
  // `*runnable_left` (when given) says how many runnable ones it left.
  static constexpr int kOnHost = -1;
  absl::StatusOr<std::shared_ptr<Region>> Run(const std::shared_ptr<const QuantBatch>& batch,
                                              const std::vector<QuantSource>& sources,
                                              SlotPool& pool, unsigned threads, bool partial,
                                              uint64_t* nonfinite_added, uint64_t* values,
                                              int device = kOnHost, size_t max_tasks = SIZE_MAX,
                                              size_t* runnable_left = nullptr);

  // Forgets the tasks of `batch` run so far that read bytes of piece `piece` in `ranges` (bytes
  // a pull fetched again after they were quantized: their checksums failed): a later Run
  // quantizes them again, from the bytes that passed. Nothing once the batch finished.
  void Forget(const QuantBatch& batch, uint32_t piece,
              const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

  // Inf and NaN source values in the blocks quantized so far.
  uint64_t nonfinite() const { return nonfinite_.load(); }

  // The slot of `batch` once every task ran without error; null otherwise (nothing runs).
  std::shared_ptr<Region> Slot(const QuantBatch* batch);
  // Sparse Apply: the change list of `batch`'s slot (set once it is finished; Slot).
  void SetChanges(const QuantBatch* batch, DerivedChanges changes);
  DerivedChanges Changes(const QuantBatch* batch);

 private:
  struct Entry {
    std::shared_ptr<const QuantBatch> batch;  // keeps the key alive
    common::Mutex run_mu;                     // one runner at a time
    std::shared_ptr<Region> slot;
    absl::Status status;
    std::vector<char> done;           // per task
    std::vector<uint64_t> nonfinite;  // per task run, what it counted
    size_t left = 0;
    bool finished = false;
    DerivedChanges changes;  // guarded by QuantCache::mu_
  };
  common::Mutex mu_;
  std::map<const QuantBatch*, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> nonfinite_{0};
};

}  // namespace refit
