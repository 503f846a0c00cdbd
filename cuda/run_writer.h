#pragma once

// A sparse Apply's writes into one destination region as a list of byte runs (byte_run.h): what
// the store's run-list sparse Apply (daemon/store/store_sparse_runs.cc) drives, the same way for
// GPU and host memory. A writer is opened for one region (cuda::OpenRunWriter in cuda.h picks
// the CUDA one for GPU memory, HostRunWriter for host memory) and used in this order:
//
//   Upload(runs, values)  the runs (inside the region, not overlapping) and their new bytes,
//                         run i's at values[runs[i].value_offset];
//   SaveOld(old)          the region's current bytes at the runs, packed like the values, into
//                         host memory: the undo record (and the check that it held the base);
//   Scatter()             the new bytes written at the runs;
//   ReadBack(landed)      what the region holds at the runs now, packed like the values (the
//                         verify compares it with them);
//   Restore(old)          the saved bytes written back (an error after Scatter).
//
// Every call returns when its work is done (the CUDA writer synchronizes its stream). Not
// thread-safe: one caller at a time; writers of different regions are independent.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/byte_run.h"
#include "daemon/memory/region.h"

namespace refit::cuda {

class RunWriter {
 public:
  virtual ~RunWriter() = default;
  // INVALID_ARGUMENT for a run outside the region or outside `values` (nothing uploaded). The
  // writer may keep references to `runs` and `values` until its last call (the host one does;
  // the CUDA one copies them to the device), so they must outlive it.
  virtual absl::Status Upload(const std::vector<ByteRun>& runs,
                              const std::vector<uint8_t>& values) = 0;
  // `old` holds at least the uploaded values' size.
  virtual absl::Status SaveOld(uint8_t* old) = 0;
  virtual absl::Status Scatter() = 0;
  // `landed` holds at least the uploaded values' size.
  virtual absl::Status ReadBack(uint8_t* landed) = 0;
  // `old`: what SaveOld gave.
  virtual absl::Status Restore(const uint8_t* old) = 0;
};

// Opens writers: the store's seam for tests (StoreOptions::sparse_run_writers), which makes host
// DESTINATION buffers take the run-list path too.
class RunWriters {
 public:
  virtual ~RunWriters() = default;
  virtual absl::StatusOr<std::unique_ptr<RunWriter>> Open(const Region& dst) = 0;
};

// INVALID_ARGUMENT unless every run lies in [0, region_bytes) and in [0, values_bytes).
absl::Status CheckRuns(const std::vector<ByteRun>& runs, uint64_t region_bytes,
                       uint64_t values_bytes);

// The host writer: cpu::ScatterRuns / cpu::GatherRuns on host memory. FAILED_PRECONDITION for a
// region that is not host memory.
absl::StatusOr<std::unique_ptr<RunWriter>> OpenHostRunWriter(const Region& dst);

}  // namespace refit::cuda
