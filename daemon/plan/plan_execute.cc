// ExecuteOnHost and its verified variants: run a plan (BuildPlan, plan.cc) with memcpy, strided
// copies and conversions, cut into tasks shared by up to 8 cores; check, save and restore what
// each task wrote.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/common/test_hooks.h"
#include "daemon/common/types.h"
#include "daemon/memory/stream_copy.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/plan.h"

namespace refit::plan {

namespace {

// Ops moving at least this much use non-temporal stores: the destination isn't read again
// soon, and skipping the read-for-ownership of each line nearly doubles the copy rate for the
// medium-sized pieces (under glibc's own streaming threshold) that resharding produces.
constexpr uint64_t kStreamOpBytes = 1 << 20;

// Above this, glibc's memcpy streams by itself, faster than StreamCopy.
constexpr uint64_t kLibcStreamBytes = 16 << 20;

void Copy(uint8_t* to, const uint8_t* from, uint64_t n, bool stream) {
  if (stream && n < kLibcStreamBytes) {
    StreamCopy(to, from, n);
  } else {
    std::memcpy(to, from, n);
  }
}

bool IsMemcpyOp(const CopyOp& op) {
  return op.src_dtype == op.dst_dtype && op.src_stride == 1 && op.dst_stride == 1;
}

// Ops [first, last) fill side by side the same destination rows (a row-split tensor gathered
// from several sources): copying them row by row keeps each destination row hot in cache.
size_t RowGroupEnd(const std::vector<CopyOp>& ops, size_t first) {
  const CopyOp& a = ops[first];
  size_t last = first + 1;
  if (a.rows < 2 || !IsMemcpyOp(a)) return last;
  const uint64_t elem = DTypeSize(a.dst_dtype);
  while (last < ops.size()) {
    const CopyOp& prev = ops[last - 1];
    const CopyOp& b = ops[last];
    if (!IsMemcpyOp(b) || b.rows != a.rows || b.dst_location != a.dst_location ||
        b.dst_row_stride != a.dst_row_stride || b.dst_dtype != a.dst_dtype ||
        b.dst_offset != prev.dst_offset + prev.count * elem) {
      break;
    }
    ++last;
  }
  return last;
}

}  // namespace

namespace {

// A piece of a plan's execution: ops [first, last) (one op, or a row group), rows
// [row_begin, row_end) of it, and elements [elem_begin, elem_end) of each row.
struct Task {
  size_t first = 0, last = 0;
  uint64_t row_begin = 0, row_end = 0;
  uint64_t elem_begin = 0, elem_end = 0;
  bool stream = false;
};

// Work is cut into tasks of about this many bytes, so that threads share it evenly.
constexpr uint64_t kTaskBytes = 4 << 20;
// Below this a plan runs on the calling thread: starting threads would cost more.
constexpr uint64_t kParallelBytes = 32 << 20;

// A verified run checks each task right after it ran: small enough that the task's source and
// destination bytes are still in the core's own cache.
constexpr uint64_t kVerifiedTaskBytes = 256 << 10;

std::vector<Task> CutTasks(const std::vector<CopyOp>& ops, uint64_t* total_bytes,
                           uint64_t task_bytes = kTaskBytes) {
  std::vector<Task> tasks;
  *total_bytes = 0;
  for (size_t first = 0; first < ops.size();) {
    const size_t last = RowGroupEnd(ops, first);
    const CopyOp& op = ops[first];
    const uint64_t elem = DTypeSize(op.dst_dtype);
    uint64_t row_bytes = 0;
    for (size_t i = first; i < last; ++i) row_bytes += ops[i].count * elem;
    const uint64_t bytes = row_bytes * op.rows;
    *total_bytes += bytes;
    const bool stream = bytes >= kStreamOpBytes && (last - first > 1 || IsMemcpyOp(op));
    if (op.rows == 1 && last - first == 1) {
      // One long run: cut it by elements.
      const uint64_t step = std::max<uint64_t>(1, task_bytes / std::max<uint64_t>(1, elem));
      for (uint64_t e = 0; e < op.count; e += step) {
        tasks.push_back({first, last, 0, 1, e, std::min<uint64_t>(op.count, e + step), stream});
      }
    } else {
      const uint64_t step = std::max<uint64_t>(1, task_bytes / std::max<uint64_t>(1, row_bytes));
      for (uint64_t r = 0; r < op.rows; r += step) {
        tasks.push_back(
            {first, last, r, std::min<uint64_t>(op.rows, r + step), 0, op.count, stream});
      }
    }
    first = last;
  }
  return tasks;
}

void RunTask(const std::vector<CopyOp>& ops, const Task& t, const std::vector<const uint8_t*>& src,
             const std::vector<uint8_t*>& dst) {
  if (t.last - t.first > 1) {
    // A row group: destination rows filled side by side, each kept hot while it fills.
    const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      for (size_t i = t.first; i < t.last; ++i) {
        const CopyOp& op = ops[i];
        Copy(dst[op.dst_location] + op.dst_offset +
                 r * static_cast<uint64_t>(op.dst_row_stride) * elem,
             src[op.src_location] + op.src_offset +
                 r * static_cast<uint64_t>(op.src_row_stride) * elem,
             op.count * elem, t.stream);
      }
    }
    return;
  }
  const CopyOp& op = ops[t.first];
  const uint64_t src_elem = DTypeSize(op.src_dtype);
  const uint64_t dst_elem = DTypeSize(op.dst_dtype);
  const uint64_t n = t.elem_end - t.elem_begin;
  const uint8_t* from = src[op.src_location] + op.src_offset +
                        t.elem_begin * static_cast<uint64_t>(op.src_stride) * src_elem;
  uint8_t* to = dst[op.dst_location] + op.dst_offset +
                t.elem_begin * static_cast<uint64_t>(op.dst_stride) * dst_elem;
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    const uint8_t* row_from = from + r * static_cast<uint64_t>(op.src_row_stride) * src_elem;
    uint8_t* row_to = to + r * static_cast<uint64_t>(op.dst_row_stride) * dst_elem;
    if (IsMemcpyOp(op)) {
      Copy(row_to, row_from, n * src_elem, t.stream);
    } else {
      ConvertRun(row_from, op.src_dtype, op.src_stride, row_to, op.dst_dtype, op.dst_stride, n);
    }
  }
}

// True when the destination bytes of task `t` are what the plan writes there. `scratch`
// holds converted runs.
bool TaskLanded(const std::vector<CopyOp>& ops, const Task& t,
                const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                std::vector<uint8_t>* scratch) {
  if (t.last - t.first > 1) {
    const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      for (size_t i = t.first; i < t.last; ++i) {
        const CopyOp& op = ops[i];
        if (std::memcmp(dst[op.dst_location] + op.dst_offset +
                            r * static_cast<uint64_t>(op.dst_row_stride) * elem,
                        src[op.src_location] + op.src_offset +
                            r * static_cast<uint64_t>(op.src_row_stride) * elem,
                        op.count * elem) != 0) {
          return false;
        }
      }
    }
    return true;
  }
  const CopyOp& op = ops[t.first];
  const uint64_t src_elem = DTypeSize(op.src_dtype);
  const uint64_t dst_elem = DTypeSize(op.dst_dtype);
  const uint64_t n = t.elem_end - t.elem_begin;
  const uint8_t* from = src[op.src_location] + op.src_offset +
                        t.elem_begin * static_cast<uint64_t>(op.src_stride) * src_elem;
  const uint8_t* to = dst[op.dst_location] + op.dst_offset +
                      t.elem_begin * static_cast<uint64_t>(op.dst_stride) * dst_elem;
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    const uint8_t* row_from = from + r * static_cast<uint64_t>(op.src_row_stride) * src_elem;
    const uint8_t* row_to = to + r * static_cast<uint64_t>(op.dst_row_stride) * dst_elem;
    if (IsMemcpyOp(op)) {
      if (std::memcmp(row_to, row_from, n * src_elem) != 0) return false;
      continue;
    }
    // What the op writes, packed, then compared element by element at the op's stride.
    scratch->resize(n * dst_elem);
    ConvertRun(row_from, op.src_dtype, op.src_stride, scratch->data(), op.dst_dtype, 1, n);
    if (op.dst_stride == 1) {
      if (std::memcmp(row_to, scratch->data(), n * dst_elem) != 0) return false;
      continue;
    }
    for (uint64_t e = 0; e < n; ++e) {
      if (std::memcmp(row_to + e * static_cast<uint64_t>(op.dst_stride) * dst_elem,
                      scratch->data() + e * dst_elem, dst_elem) != 0) {
        return false;
      }
    }
  }
  return true;
}

// The fused verified copy: memcpy ops are copied with ordinary (write-back) stores and what
// landed is compared with the source once about kFusedBytes were copied, while those source and
// destination bytes are still in the core's own cache (reading them again costs little there).
// The compare loads the destination's cache lines, which another core or a device writing into
// that memory would have changed or invalidated: it checks the memory, not the copy's registers.
// One thread copying 256 MiB, CPU time against a streaming copy (docs/benchmarks.md, "Verified
// apply"): ordinary stores alone 0.88-0.91x (the write-allocate of each destination line), with
// the compare every 8 KiB 0.70-0.72x, every 16-32 KiB 0.78-0.88x, every 256 KiB 0.77-0.79x.
constexpr uint64_t kFusedBytes = 32 << 10;

// Copies runs and compares them in batches of about kFusedBytes: many short runs (a column
// shard's rows) are compared together, a long run in kFusedBytes pieces. One per thread.
class CheckedCopy {
 public:
  CheckedCopy() { runs_.reserve(64); }

  void Run(uint8_t* to, const uint8_t* from, uint64_t n) {
    while (n > 0) {
      const uint64_t k = std::min(n, kFusedBytes - pending_);
      std::memcpy(to, from, k);
      runs_.push_back({to, from, k});
      pending_ += k;
      if (pending_ >= kFusedBytes) Compare();
      to += k;
      from += k;
      n -= k;
    }
  }

  // Compares what is left; true when every byte copied since the last call landed.
  bool Landed() {
    Compare();
    const bool landed = landed_;
    landed_ = true;
    return landed;
  }

 private:
  struct CopiedRun {
    const uint8_t* to;
    const uint8_t* from;
    uint64_t n;
  };

  void Compare() {
    for (const CopiedRun& r : runs_) landed_ &= std::memcmp(r.to, r.from, r.n) == 0;
    runs_.clear();
    pending_ = 0;
  }

  std::vector<CopiedRun> runs_;
  uint64_t pending_ = 0;
  bool landed_ = true;
};

// Task `t` of memcpy ops, run and checked in one pass (CheckedCopy); false when a byte of it
// did not land.
// Where ExecuteSaveAndVerifyOnHost saves what each op overwrites. The ops of a row group
// (RowGroupEnd) are saved together, row by row, each row as it lies in the destination (the
// group's runs side by side); an op of its own row by row. So a task's rows are saved with
// one streaming copy per row, or one in all where the destination rows follow each other.
struct SaveArea {
  uint8_t* saved = nullptr;
  std::vector<uint64_t> at;         // per op: where its row 0 is saved
  std::vector<uint64_t> row_bytes;  // per op: its group's row, saved

  // `layout`: the offsets alone (RestorePlan), with no area to save into.
  SaveArea(const std::vector<CopyOp>& ops, uint8_t* to, bool layout = false) : saved(to) {
    if (saved == nullptr && !layout) return;
    at.resize(ops.size());
    row_bytes.resize(ops.size());
    uint64_t offset = 0;
    for (size_t first = 0; first < ops.size();) {
      const size_t last = RowGroupEnd(ops, first);
      uint64_t row = 0;
      for (size_t i = first; i < last; ++i) {
        at[i] = offset + row;
        row += ops[i].count * DTypeSize(ops[i].dst_dtype);
      }
      for (size_t i = first; i < last; ++i) row_bytes[i] = row;
      offset += ops[first].rows * row;
      first = last;
    }
  }
  // Where element `e` of row `r` of op `i` is saved.
  uint8_t* For(const std::vector<CopyOp>& ops, size_t i, uint64_t r, uint64_t e) const {
    return saved + at[i] + r * row_bytes[i] + e * DTypeSize(ops[i].dst_dtype);
  }
};

// The first and one-past-last element of each row that task `t` covers of op `i`.
std::pair<uint64_t, uint64_t> TaskElems(const std::vector<CopyOp>& ops, const Task& t, size_t i) {
  if (t.last - t.first > 1) return {0, ops[i].count};
  return {t.elem_begin, t.elem_end};
}

// Saves the destination bytes task `t` will overwrite (before it runs).
void SaveTask(const std::vector<CopyOp>& ops, const Task& t, const std::vector<uint8_t*>& dst,
              const SaveArea& save) {
  const CopyOp& op = ops[t.first];
  const uint64_t elem = DTypeSize(op.dst_dtype);
  const auto [begin, end] = TaskElems(ops, t, t.first);
  const uint64_t row = save.row_bytes[t.first];
  auto dst_at = [&](uint64_t r, uint64_t e) {
    return dst[op.dst_location] + op.dst_offset +
           (r * static_cast<uint64_t>(op.dst_row_stride) +
            e * static_cast<uint64_t>(op.dst_stride)) *
               elem;
  };
  if (op.dst_stride == 1 && (t.last - t.first > 1 || end - begin == op.count)) {
    // Whole rows, each contiguous in the destination (a row group's runs lie side by side).
    if (t.row_end - t.row_begin == 1 || static_cast<uint64_t>(op.dst_row_stride) * elem == row) {
      StreamCopy(save.For(ops, t.first, t.row_begin, 0), dst_at(t.row_begin, 0),
                 (t.row_end - t.row_begin) * row);
      return;
    }
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      StreamCopy(save.For(ops, t.first, r, 0), dst_at(r, 0), row);
    }
    return;
  }
  // One op: part of each row, or strided elements.
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    uint8_t* to = save.For(ops, t.first, r, begin);
    if (op.dst_stride == 1) {
      StreamCopy(to, dst_at(r, begin), (end - begin) * elem);
      continue;
    }
    for (uint64_t e = begin; e < end; ++e) std::memcpy(to + (e - begin) * elem, dst_at(r, e), elem);
  }
}

bool RunAndCompareTask(const std::vector<CopyOp>& ops, const Task& t,
                       const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                       CheckedCopy* copy) {
  const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    for (size_t i = t.first; i < t.last; ++i) {
      const CopyOp& op = ops[i];
      const auto [begin, end] = TaskElems(ops, t, i);
      copy->Run(dst[op.dst_location] + op.dst_offset +
                    (r * static_cast<uint64_t>(op.dst_row_stride) + begin) * elem,
                src[op.src_location] + op.src_offset +
                    (r * static_cast<uint64_t>(op.src_row_stride) + begin) * elem,
                (end - begin) * elem);
    }
  }
  return copy->Landed();
}

// Runs `work` (one call per thread; it takes tasks from `next` until none is left) on up to 8
// cores, or on the calling thread alone for plans under kParallelBytes.
void OnCores(size_t tasks, uint64_t total, const std::function<void()>& work) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads =
      total < kParallelBytes
          ? 1u
          : static_cast<unsigned>(std::min<uint64_t>({cores, 8u, std::max<uint64_t>(1, tasks)}));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

// Runs (when `run`) and checks every task on up to 8 cores; the ops of tasks that didn't land.
// With `saved`, each task's destination bytes are saved there first (ExecuteSaveAndVerifyOnHost).
std::vector<size_t> RunAndCheck(const Plan& plan, const std::vector<const uint8_t*>& src,
                                const std::vector<uint8_t*>& dst, bool run,
                                uint8_t* saved = nullptr, uint8_t* marks = nullptr) {
  const SaveArea save(plan.ops, run ? saved : nullptr);
  uint64_t total = 0;
  std::vector<Task> tasks = CutTasks(plan.ops, &total, kVerifiedTaskBytes);
  // Checked at once, the destination bytes must still be in cache: no streaming stores.
  for (Task& t : tasks) t.stream = false;
  // Test build only: a destination byte changes under the first task's copy (a concurrent
  // writer), in the first N verified applies.
  static std::atomic<long> flips{-1};
  if (run && flips.load() < 0) {
    const char* flip = TestSwitch("REFIT_FAULT_APPLY_FLIP");
    long expected = -1;
    flips.compare_exchange_strong(expected, flip ? std::atol(flip) : 0);
  }
  // Saves task i's destination bytes (with `saved`), then marks it saved (with `marks`): the
  // saved bytes reach memory before the mark, the mark before the task's first write.
  auto save_first = [&](size_t i) {
    if (save.saved == nullptr) return;
    SaveTask(plan.ops, tasks[i], dst, save);
    if (marks == nullptr) return;
    StoreFence();
    __atomic_store_n(&marks[i], uint8_t{1}, __ATOMIC_SEQ_CST);
  };
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::vector<size_t> bad;
  OnCores(tasks.size(), total, [&] {
    std::vector<uint8_t> scratch;
    CheckedCopy copy;
    for (size_t i = next++; i < tasks.size(); i = next++) {
      const bool flip = i == 0 && flips.load(std::memory_order_relaxed) > 0;
      if (run && !flip && IsMemcpyOp(plan.ops[tasks[i].first])) {
        // Copied and compared in one pass (a row group's ops are all memcpy ops).
        // With the undo save folded in, the task's destination bytes are saved first: that
        // read brings them into this core's cache, where the copy then overwrites them.
        save_first(i);
        const bool landed = RunAndCompareTask(plan.ops, tasks[i], src, dst, &copy);
        if (i == tasks.size() / 2) TestHookKillAt("apply");  // test build: a commit point
        if (!landed) {
          std::lock_guard<std::mutex> lock(mu);
          for (size_t op = tasks[i].first; op < tasks[i].last; ++op) bad.push_back(op);
        }
        continue;
      }
      if (run) {
        save_first(i);
        RunTask(plan.ops, tasks[i], src, dst);
        if (i == tasks.size() / 2) TestHookKillAt("apply");  // test build: a commit point
        if (i == 0 && flips.load(std::memory_order_relaxed) > 0 && flips-- > 0) {
          const CopyOp& op = plan.ops[tasks[i].first];
          dst[op.dst_location][op.dst_offset] ^= 0x5a;
        }
      }
      if (!TaskLanded(plan.ops, tasks[i], src, dst, &scratch)) {
        std::lock_guard<std::mutex> lock(mu);
        for (size_t op = tasks[i].first; op < tasks[i].last; ++op) bad.push_back(op);
      }
    }
    if (save.saved != nullptr) StoreFence();  // the saved bytes' streaming stores
  });
  std::sort(bad.begin(), bad.end());
  bad.erase(std::unique(bad.begin(), bad.end()), bad.end());
  return bad;
}

}  // namespace

std::vector<size_t> ExecuteAndVerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                           const std::vector<uint8_t*>& dst) {
  return RunAndCheck(plan, src, dst, /*run=*/true);
}

std::vector<size_t> ExecuteSaveAndVerifyOnHost(const Plan& plan,
                                               const std::vector<const uint8_t*>& src,
                                               const std::vector<uint8_t*>& dst, uint8_t* saved,
                                               uint8_t* marks) {
  return RunAndCheck(plan, src, dst, /*run=*/true, saved, marks);
}

uint64_t SavedBytes(const Plan& plan) {
  uint64_t bytes = 0;
  for (const CopyOp& op : plan.ops) bytes += op.rows * op.count * DTypeSize(op.dst_dtype);
  return bytes;
}

uint64_t SaveTasks(const Plan& plan) {
  uint64_t total = 0;
  return CutTasks(plan.ops, &total, kVerifiedTaskBytes).size();
}

Plan RestorePlan(const Plan& plan, const uint8_t* marks, std::vector<uint32_t>* pieces) {
  const SaveArea layout(plan.ops, nullptr, /*layout=*/true);
  Plan back;
  // Op i's rows [row_begin, row_end) and elements [begin, end) of each, from where they were saved.
  auto add = [&](size_t i, uint64_t row_begin, uint64_t row_end, uint64_t begin, uint64_t end) {
    const CopyOp& op = plan.ops[i];
    const uint64_t elem = DTypeSize(op.dst_dtype);
    CopyOp r = op;
    r.dst_offset = op.dst_offset + (row_begin * static_cast<uint64_t>(op.dst_row_stride) +
                                    begin * static_cast<uint64_t>(op.dst_stride)) *
                                       elem;
    r.count = end - begin;
    r.rows = row_end - row_begin;
    r.src_location = 0;
    r.src_offset = layout.at[i] + row_begin * layout.row_bytes[i] + begin * elem;
    r.src_stride = 1;
    r.src_dtype = op.dst_dtype;
    r.src_row_stride = static_cast<int64_t>(layout.row_bytes[i] / elem);
    back.ops.push_back(r);
    back.dst_bytes += r.rows * r.count * elem;
  };
  if (marks == nullptr && pieces == nullptr) {
    for (size_t i = 0; i < plan.ops.size(); ++i) add(i, 0, plan.ops[i].rows, 0, plan.ops[i].count);
  } else {
    uint64_t total = 0;
    const std::vector<Task> tasks = CutTasks(plan.ops, &total, kVerifiedTaskBytes);
    for (size_t k = 0; k < tasks.size(); ++k) {
      if (marks != nullptr && marks[k] == 0) continue;
      const Task& t = tasks[k];
      for (size_t i = t.first; i < t.last; ++i) {
        const auto [begin, end] = TaskElems(plan.ops, t, i);
        add(i, t.row_begin, t.row_end, begin, end);
        if (pieces != nullptr) pieces->push_back(static_cast<uint32_t>(k));
      }
    }
  }
  back.src_bytes = back.dst_bytes;
  return back;
}

std::vector<size_t> VerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                 const std::vector<uint8_t*>& dst) {
  return RunAndCheck(plan, src, dst, /*run=*/false);
}

void ExecuteOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                   const std::vector<uint8_t*>& dst) {
  uint64_t total = 0;
  const std::vector<Task> tasks = CutTasks(plan.ops, &total);
  std::atomic<size_t> next{0};
  OnCores(tasks.size(), total, [&] {
    for (size_t i = next++; i < tasks.size(); i = next++) RunTask(plan.ops, tasks[i], src, dst);
    StoreFence();
  });
}

}  // namespace refit::plan
