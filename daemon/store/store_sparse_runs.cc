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
#include "daemon/store/sparse_walk.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

using sparse::CopyBytes;
using sparse::DstAt;
using sparse::ForEachWrite;
using sparse::kCheckEvery;
using sparse::kMaxThreads;
using sparse::kParallelRuns;
using sparse::ParallelFor;
using sparse::PlainOp;
using sparse::SparseWrite;
using sparse::SplitOps;
using sparse::SrcAt;
using sparse::WorkItem;

// One destination's writes: byte runs, their new bytes (packed in run order), which op's runs
// start where (the first run of each stretch of one op's runs, with the op: NotLanded names its
// tensors), and the writes checked against the base: [offset, offset + bytes) of `values`, with
// the base's bytes there back to back in `expected`.
struct RunList {
  std::vector<cuda::ByteRun> runs;
  std::vector<std::pair<uint64_t, uint32_t>> ops;
  std::vector<uint8_t> values;
  std::vector<std::pair<uint64_t, uint64_t>> checks;
  std::vector<uint8_t> expected;
};

// The visitor of ForEachWrite that collects instead of writing: each write's new bytes (from
// the change list where it carries them, else converted from the new version's slot, as the host
// sparse Apply writes them), one run for a contiguous write or one per element for a strided
// destination, and, for every kCheckEvery-th change run's write and each op's first, the base's
// bytes there (what the destination must hold: else the full copy runs).
class RunCollector {
 public:
  RunCollector(const plan::Plan& plan, const sparse::Sources& sources, std::vector<RunList>* lists,
               uint64_t runs_hint)
      : plan_(plan), sources_(sources), lists_(*lists) {
    // Room for about the runs expected (a strided destination has more: the vectors grow).
    for (RunList& list : lists_) {
      list.runs.reserve(runs_hint);
      list.values.reserve(runs_hint * 4);
    }
  }

  void Ahead(const plan::CopyOp& op, uint64_t row, uint64_t element, uint64_t run) {
    if (element >= op.count) return;
    if (!PlainOp(op)) __builtin_prefetch(sources_.src[op.src_location] + SrcAt(op, row, element));
    if (run % kCheckEvery == 0) {
      __builtin_prefetch(sources_.base[op.src_location] + SrcAt(op, row, element));
    }
  }

  bool Write(const SparseWrite& w) {
    const plan::CopyOp& op = plan_.ops[w.op];
    RunList& list = lists_[op.dst_location];
    const uint64_t n = w.last - w.first;
    const uint64_t de = DTypeSize(op.dst_dtype);
    const uint64_t bytes = n * de;
    const uint64_t at = DstAt(op, w.row, w.first);
    const uint64_t from = SrcAt(op, w.row, w.first);
    const uint64_t value_at = list.values.size();
    list.values.resize(value_at + bytes);
    uint8_t* value = list.values.data() + value_at;
    if (PlainOp(op)) {
      const uint8_t* carried = sources_.changes[op.src_location]->Values(w.run, from, bytes);
      CopyBytes(value, carried ? carried : sources_.src[op.src_location] + from, bytes);
    } else {
      plan::ConvertRun(sources_.src[op.src_location] + from, op.src_dtype, op.src_stride, value,
                       op.dst_dtype, 1, n);
    }
    if (list.ops.empty() || list.ops.back().second != w.op) {
      list.ops.emplace_back(list.runs.size(), w.op);
    } else if (op.dst_stride == 1 && !list.runs.empty() &&
               list.runs.back().dst_offset + list.runs.back().bytes == at &&
               list.runs.back().value_offset + list.runs.back().bytes == value_at) {
      list.runs.back().bytes += bytes;  // continues the previous run (the next row of a shard)
      return Checked(op, w, list, value_at, from, n);
    }
    if (op.dst_stride == 1) {
      list.runs.push_back({at, value_at, bytes});
    } else {
      const uint64_t stride = static_cast<uint64_t>(op.dst_stride) * de;
      for (uint64_t e = 0; e < n; ++e)
        list.runs.push_back({at + e * stride, value_at + e * de, de});
    }
    return Checked(op, w, list, value_at, from, n);
  }

 private:
  // Every kCheckEvery-th change run's write and each op's first: the base's bytes there kept.
  bool Checked(const plan::CopyOp& op, const SparseWrite& w, RunList& list, uint64_t value_at,
               uint64_t from, uint64_t n) {
    const uint64_t bytes = n * DTypeSize(op.dst_dtype);
    if (w.run % kCheckEvery == 0 || w.op != last_op_) {
      list.checks.emplace_back(value_at, bytes);
      const uint64_t expected_at = list.expected.size();
      list.expected.resize(expected_at + bytes);
      plan::ConvertRun(sources_.base[op.src_location] + from, op.src_dtype, op.src_stride,
                       list.expected.data() + expected_at, op.dst_dtype, 1, n);
    }
    last_op_ = w.op;
    return true;
  }

  const plan::Plan& plan_;
  const sparse::Sources& sources_;
  std::vector<RunList>& lists_;
  uint32_t last_op_ = UINT32_MAX;
};

// Appends `part` to `into`, its offsets into the values moved past what `into` holds.
void Append(RunList& into, const RunList& part) {
  const uint64_t shift = into.values.size();
  const size_t first = into.runs.size();
  into.runs.insert(into.runs.end(), part.runs.begin(), part.runs.end());
  for (size_t r = first; r < into.runs.size(); ++r) into.runs[r].value_offset += shift;
  for (const auto& [run, op] : part.ops) into.ops.emplace_back(run + first, op);
  into.values.insert(into.values.end(), part.values.begin(), part.values.end());
  for (const auto& [at, bytes] : part.checks) into.checks.emplace_back(at + shift, bytes);
  into.expected.insert(into.expected.end(), part.expected.begin(), part.expected.end());
}

// The run lists of every destination: the plan's work items cut into chunks (four per thread),
// collected on `threads` threads, appended in item order.
std::vector<RunList> CollectRuns(const plan::Plan& plan, const sparse::Sources& sources,
                                 size_t dests, unsigned threads) {
  const std::vector<WorkItem> items = SplitOps(plan, sources.changes);
  const size_t chunks = std::max<size_t>(1, std::min<size_t>(items.size(), threads * 4u));
  std::vector<std::vector<RunList>> parts(chunks, std::vector<RunList>(dests));
  std::atomic<size_t> next{0};
  ParallelFor(std::min<unsigned>(threads, static_cast<unsigned>(chunks)), [&](unsigned) {
    for (size_t c = next++; c < chunks; c = next++) {
      RunCollector collector(plan, sources, &parts[c], sources.runs / chunks + 16);
      ForEachWrite(plan, sources.changes, items.data() + items.size() * c / chunks,
                   items.data() + items.size() * (c + 1) / chunks, collector);
    }
  });
  if (chunks == 1) return std::move(parts[0]);
  std::vector<RunList> lists(dests);
  // One thread per destination would leave most idle (an engine has one or two buffers); the
  // appends are memcpy-bound and a small share of the collection.
  for (size_t j = 0; j < dests; ++j) {
    size_t runs = 0, values = 0;
    for (const std::vector<RunList>& part : parts) {
      runs += part[j].runs.size();
      values += part[j].values.size();
    }
    lists[j].runs.reserve(runs);
    lists[j].values.reserve(values);
    for (std::vector<RunList>& part : parts) {
      Append(lists[j], part[j]);
      part[j] = RunList();  // freed as it goes
    }
  }
  return lists;
}

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Each destination's writer with what its runs held before (the undo record).
struct DestinationWrite {
  std::unique_ptr<cuda::RunWriter> writer;
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

std::optional<absl::StatusOr<ApplyResult>> Store::ApplySparseRuns(
    const Version& version, uint64_t base, const plan::Plan& plan, const sparse::Sources& sources,
    const std::vector<std::shared_ptr<Buffer>>& dests) {
  const auto t_start = Clock::now();
  const double cpu_start = CpuSeconds();
  static const char* forced = TestSwitch("REFIT_TEST_SPARSE_THREADS");
  const unsigned wanted =
      forced ? static_cast<unsigned>(std::atoi(forced)) : options_.sparse_threads;
  const unsigned threads =
      wanted > 0 ? wanted
                 : (sources.runs < kParallelRuns
                        ? 1u
                        : std::min(std::max(1u, std::thread::hardware_concurrency()), kMaxThreads));
  std::vector<RunList> lists = CollectRuns(plan, sources, dests.size(), threads);
  const double cpu_built = CpuSeconds();
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
    const Region& region = *dests[j]->region;
    auto writer = options_.sparse_run_writers ? options_.sparse_run_writers->Open(region)
                                              : cuda::OpenRunWriter(region);
    if (!writer.ok()) return full_copy(j, writer.status().ToString());
    DestinationWrite& write = writes[j];
    write.writer = std::move(writer).value();
    absl::Status status = write.writer->Upload(list.runs, list.values);
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
      "sparse Apply (run list) of version {}: {} runs, {} bytes, {} thread(s): collected {:.1f} ms "
      "({:.1f} ms CPU), uploaded and saved {:.1f} ms, written and verified {:.1f} ms",
      version.number, run_count, written, threads, ms(t_start, t_built),
      (cpu_built - cpu_start) * 1e3, ms(t_built, t_saved), ms(t_saved, Clock::now()));
  return absl::StatusOr<ApplyResult>(ApplyResult{version.number, written, saved, true});
}

}  // namespace refit
