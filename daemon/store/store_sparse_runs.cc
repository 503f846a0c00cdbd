// The run-list sparse Apply: the sparse Apply for GPU DESTINATION buffers (and, with the test
// seam StoreOptions::sparse_run_writers, host ones). The writes are the host sparse Apply's
// (sparse_walk.h's ForEachWrite, the same plan, the same plan::ConvertRun), collected on the
// host per destination as byte runs with their new bytes in the destination's dtype; each
// destination's cuda::RunWriter (run_writer.h) then uploads them, saves the bytes they replace
// (the undo record, kept in memory: not in the apply journal, so a kill is not undone for these
// destinations), writes them (gpu::ScatterRuns), reads back what landed (gpu::GatherRuns) and
// the host compares it with the values. docs/architecture.md, "Sparse Apply".

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "cuda/run_writer.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/plan.h"
#include "daemon/store/sparse_runs.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

using sparse::RunList;

// Each destination's writer with what its runs held before (the undo record).
struct DestinationWrite {
  cuda::RunWriter* writer = nullptr;  // `owned`, or one uploaded as the version completed
  std::unique_ptr<cuda::RunWriter> owned;
  std::vector<uint8_t> old;
  bool scattered = false;  // Scatter was called (it may have written part of the runs)
};

// Puts back what every scattered destination held, except those in `skip`; the first error.
absl::Status RestoreAll(std::vector<DestinationWrite>& writes, const std::vector<bool>& skip) {
  absl::Status first = absl::OkStatus();
  for (size_t j = 0; j < writes.size(); ++j) {
    if (!writes[j].scattered || (j < skip.size() && skip[j])) continue;
    absl::Status restored = writes[j].writer->Restore(writes[j].old.data());
    if (!restored.ok() && first.ok()) first = restored;
  }
  return first;
}

}  // namespace

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::optional<absl::StatusOr<ApplyResult>> Store::ApplySparseRuns(
    const Version& version, uint64_t base, const plan::Plan& plan,
    const std::vector<RunList>& lists, const std::string& how,
    const std::vector<std::shared_ptr<Buffer>>& dests,
    std::vector<std::unique_ptr<cuda::RunWriter>>* uploaded) {
  const auto t_built = Clock::now();

  // Upload, save what the runs hold and check it against the base: nothing is written yet, so
  // any refusal here leaves the full copy to run.
  auto full_copy = [&](size_t j, const std::string& why) {
    Logger("store")->info("Apply of version {} into {}: {}: full copy", version.number,
                          dests[j]->id, why);
    return std::nullopt;
  };
  std::vector<DestinationWrite> writes(dests.size());
  uint64_t written = 0, saved = 0, run_count = 0;
  for (size_t j = 0; j < dests.size(); ++j) {
    const RunList& list = lists[j];
    if (list.runs.empty()) continue;
    DestinationWrite& write = writes[j];
    absl::Status status = absl::OkStatus();
    if (uploaded && j < uploaded->size() && (*uploaded)[j]) {
      write.writer = (*uploaded)[j].get();  // the runs and values are on the device already
    } else {
      const Region& region = *dests[j]->region;
      auto writer = options_.sparse_run_writers ? options_.sparse_run_writers->Open(region)
                                                : cuda::OpenRunWriter(region);
      if (!writer.ok()) return full_copy(j, writer.status().ToString());
      write.owned = std::move(writer).value();
      write.writer = write.owned.get();
      status = write.writer->Upload(list.runs, list.values);
    }
    write.old.resize(list.values.size());
    if (status.ok()) status = write.writer->SaveOld(write.old.data());
    if (!status.ok()) return full_copy(j, status.ToString());
    uint64_t expected_at = 0;
    for (const auto& [at, bytes] : list.checks) {
      if (std::memcmp(write.old.data() + at, list.expected.data() + expected_at, bytes) != 0) {
        // An engine that wrote into its buffer since (a bulk overwrite always shows here).
        return full_copy(j, absl::StrCat("it does not hold version ", base,
                                         " where this step writes (written since?)"));
      }
      expected_at += bytes;
    }
    written += list.values.size();
    saved += write.old.size();
    run_count += list.runs.size();
  }
  const auto t_saved = Clock::now();

  // Write; from here on every error puts the saved bytes back.
  for (size_t j = 0; j < dests.size(); ++j) {
    if (!writes[j].writer) continue;
    writes[j].scattered = true;
    absl::Status status = writes[j].writer->Scatter();
    if (!status.ok()) {
      absl::Status restored = RestoreAll(writes, {});
      return absl::StatusOr<ApplyResult>(absl::InternalError(absl::StrCat(
          "Apply of version ", version.number, " into ", dests[j]->id, ": ", status.ToString(),
          restored.ok() ? " (every destination buffer was put back as it was)"
                        : absl::StrCat(" (putting the destinations back failed too: ",
                                       restored.ToString(), ")"))));
    }
  }
  // Verified install: what landed, read back, against the values.
  std::vector<size_t> bad;
  std::vector<uint8_t> landed;
  for (size_t j = 0; j < dests.size(); ++j) {
    if (!writes[j].writer) continue;
    const RunList& list = lists[j];
    landed.resize(list.values.size());
    absl::Status status = writes[j].writer->ReadBack(landed.data());
    if (!status.ok()) {
      absl::Status restored = RestoreAll(writes, {});
      return absl::StatusOr<ApplyResult>(absl::InternalError(
          absl::StrCat("Apply of version ", version.number, " into ", dests[j]->id,
                       ": reading back what was written: ", status.ToString(),
                       restored.ok() ? " (every destination buffer was put back as it was)" : "")));
    }
    if (std::memcmp(landed.data(), list.values.data(), landed.size()) == 0) continue;
    for (size_t k = 0; k < list.ops.size(); ++k) {
      const uint64_t end = k + 1 < list.ops.size() ? list.ops[k + 1].first : list.runs.size();
      for (uint64_t r = list.ops[k].first; r < end; ++r) {
        const cuda::ByteRun& run = list.runs[r];
        if (std::memcmp(landed.data() + run.value_offset, list.values.data() + run.value_offset,
                        run.bytes) != 0) {
          bad.push_back(list.ops[k].second);
          break;
        }
      }
    }
  }
  if (!bad.empty()) {
    std::sort(bad.begin(), bad.end());
    bad.erase(std::unique(bad.begin(), bad.end()), bad.end());
    const bool restored = RestoreAll(writes, {}).ok();
    return absl::StatusOr<ApplyResult>(NotLanded(version, plan, bad, dests, restored));
  }
  for (const auto& d : dests) {
    if (!d->region->Broken()) continue;
    std::vector<bool> gone;
    for (const auto& other : dests) gone.push_back(other->region->Broken());
    (void)RestoreAll(writes, gone);
    return absl::StatusOr<ApplyResult>(
        MemoryWentAway(*d, " (the other destination buffers were put back as they were)"));
  }
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  Logger("store")->debug(
      "sparse Apply (run list) of version {}: {} runs, {} bytes: {}; uploaded and saved {:.1f} "
      "ms, written and verified {:.1f} ms",
      version.number, run_count, written, how, ms(t_built, t_saved), ms(t_saved, Clock::now()));
  return absl::StatusOr<ApplyResult>(ApplyResult{version.number, written, saved, true});
}

}  // namespace refit
