#pragma once

// What the two sparse Applies share (store_sparse.cc writes host destinations itself,
// store_sparse_runs.cc collects byte runs for a RunWriter): the walk over the writes a change
// list calls for (ForEachWrite, with a visitor), the work items it is cut into, and the byte
// arithmetic of a plan op. Internal to daemon/store. docs/architecture.md, "Sparse Apply".

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "daemon/common/types.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/plan.h"
#include "daemon/store/store_types.h"

namespace refit::sparse {

// What a sparse Apply reads, per source location of the plan (the pieces, then the derived slot
// of fp8 destinations with scales): its change list, the held version's bytes (the base the
// destinations hold) and the new version's bytes, all host memory; `runs`: the change runs of
// every location the plan reads.
struct Sources {
  const std::vector<const ChangeList*>& changes;
  const std::vector<const uint8_t*>& base;
  const std::vector<const uint8_t*>& src;
  uint64_t runs = 0;
};

// How many changed runs ahead a sparse Apply asks for the memory it will touch.
constexpr ptrdiff_t kAhead = 16;
// A sparse Apply checks every this-many-th write against N-1 (and each op's first).
constexpr uint64_t kCheckEvery = 16;
// A sparse Apply of at least this many changed runs is spread over up to kMaxThreads cores.
constexpr uint64_t kParallelRuns = 16384;
constexpr unsigned kMaxThreads = 8;

// Runs fn(0) .. fn(threads - 1), fn(0) on the calling thread.
template <typename Fn>
void ParallelFor(unsigned threads, Fn fn) {
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0u);
  for (std::thread& t : pool) t.join();
}

// One element run of an op that the sparse Apply writes: elements [first, last) of `row`,
// from change run `run` on (of the op's piece).
struct SparseWrite {
  uint32_t op = 0;
  uint64_t row = 0;
  uint64_t first = 0;
  uint64_t last = 0;
  uint64_t run = 0;
};

inline uint64_t SrcAt(const plan::CopyOp& op, uint64_t row, uint64_t element) {
  const uint64_t elem = DTypeSize(op.src_dtype);
  return op.src_offset + (row * static_cast<uint64_t>(op.src_row_stride) +
                          element * static_cast<uint64_t>(op.src_stride)) *
                             elem;
}

inline uint64_t DstAt(const plan::CopyOp& op, uint64_t row, uint64_t element) {
  const uint64_t elem = DTypeSize(op.dst_dtype);
  return op.dst_offset + (row * static_cast<uint64_t>(op.dst_row_stride) +
                          element * static_cast<uint64_t>(op.dst_stride)) *
                             elem;
}

// An op whose elements are bytes copied as they are (no conversion, no strides).
inline bool PlainOp(const plan::CopyOp& op) {
  return op.src_dtype == op.dst_dtype && op.src_stride == 1 && op.dst_stride == 1;
}

// memcmp for the few bytes a sparse write usually is (one bf16 element), without a call.
inline bool SameBytes(const uint8_t* a, const uint8_t* b, uint64_t n) {
  if (n == 2) {
    uint16_t x, y;
    __builtin_memcpy(&x, a, 2);
    __builtin_memcpy(&y, b, 2);
    return x == y;
  }
  if (n == 4) {
    uint32_t x, y;
    __builtin_memcpy(&x, a, 4);
    __builtin_memcpy(&y, b, 4);
    return x == y;
  }
  return std::memcmp(a, b, n) == 0;
}

inline void CopyBytes(uint8_t* to, const uint8_t* from, uint64_t n) {
  if (n == 2) {
    __builtin_memcpy(to, from, 2);
  } else if (n == 4) {
    __builtin_memcpy(to, from, 4);
  } else {
    std::memcpy(to, from, n);
  }
}

// True when what `w` wrote at `dst` is what the plan says (the source converted).
inline bool Landed(const plan::CopyOp& op, const SparseWrite& w, const uint8_t* src,
                   const uint8_t* dst, std::vector<uint8_t>* scratch) {
  const uint64_t n = w.last - w.first;
  const uint64_t de = DTypeSize(op.dst_dtype);
  scratch->resize(n * de);
  plan::ConvertRun(src + SrcAt(op, w.row, w.first), op.src_dtype, op.src_stride, scratch->data(),
                   op.dst_dtype, 1, n);
  const uint8_t* to = dst + DstAt(op, w.row, w.first);
  if (op.dst_stride == 1) return std::memcmp(to, scratch->data(), n * de) == 0;
  for (uint64_t e = 0; e < n; ++e) {
    if (std::memcmp(to + e * static_cast<uint64_t>(op.dst_stride) * de, scratch->data() + e * de,
                    de) != 0) {
      return false;
    }
  }
  return true;
}

// Rows [row_begin, row_end) of op `op`, elements [elem_begin, elem_end) of each: what one
// worker of a sparse Apply takes at a time.
struct WorkItem {
  uint32_t op = 0;
  uint64_t row_begin = 0;
  uint64_t row_end = 0;
  uint64_t elem_begin = 0;
  uint64_t elem_end = 0;
};

// The plan's ops with changes to write, each cut into about kRowParts items of rows, or an op of
// fewer rows (a contiguous tensor is one row) into kElemParts items of elements per row.
constexpr uint64_t kRowParts = 8;
constexpr uint64_t kElemParts = 32;
inline std::vector<WorkItem> SplitOps(const plan::Plan& plan,
                                      const std::vector<const ChangeList*>& changes) {
  std::vector<WorkItem> items;
  for (uint32_t k = 0; k < plan.ops.size(); ++k) {
    const plan::CopyOp& op = plan.ops[k];
    if (changes[op.src_location]->runs.empty() || op.count == 0 || op.rows == 0) continue;
    if (op.rows < kRowParts) {
      const uint64_t elems = std::max<uint64_t>(1, (op.count + kElemParts - 1) / kElemParts);
      for (uint64_t r = 0; r < op.rows; ++r) {
        for (uint64_t e = 0; e < op.count; e += elems) {
          items.push_back({k, r, r + 1, e, std::min<uint64_t>(op.count, e + elems)});
        }
      }
      continue;
    }
    const uint64_t rows = std::max<uint64_t>(1, (op.rows + kRowParts - 1) / kRowParts);
    for (uint64_t r = 0; r < op.rows; r += rows) {
      items.push_back({k, r, std::min<uint64_t>(op.rows, r + rows), 0, op.count});
    }
  }
  return items;
}

// Calls visitor.Write(w) for each element run of the items' rows whose source bytes overlap a
// changed run of their piece, in item and row order, overlapping runs of one row merged. The
// changed runs are walked once per item (rows ascending in the source move a cursor forward).
// Stops when a Write returns false.
template <typename Visitor>
void ForEachWrite(const plan::Plan& plan, const std::vector<const ChangeList*>& changes,
                  const WorkItem* items, const WorkItem* items_end, Visitor& visitor) {
  for (const WorkItem* item = items; item != items_end; ++item) {
    const uint32_t k = item->op;
    const plan::CopyOp& op = plan.ops[k];
    const ChangeRuns& runs = changes[op.src_location]->runs;
    if (runs.empty() || op.count == 0) continue;
    const uint64_t se = DTypeSize(op.src_dtype);
    const uint64_t step = static_cast<uint64_t>(op.src_stride) * se;
    const uint64_t eb = item->elem_begin, count = item->elem_end - item->elem_begin;
    if (count == 0) continue;
    SparseWrite pending;
    bool have = false;
    auto row_first = runs.begin();  // the first run that may overlap the current row
    uint64_t last_s0 = 0;
    for (uint64_t r = item->row_begin; r < item->row_end; ++r) {
      const uint64_t s0 = SrcAt(op, r, eb);
      const uint64_t s1 = s0 + (count - 1) * step + se;
      if (r == item->row_begin || s0 < last_s0) {
        row_first = std::upper_bound(
            runs.begin(), runs.end(), s0,
            [](uint64_t at, const std::pair<uint64_t, uint64_t>& run) { return at < run.second; });
      } else {
        while (row_first != runs.end() && row_first->second <= s0) ++row_first;
      }
      last_s0 = s0;
      for (auto it = row_first; it != runs.end() && it->first < s1; ++it) {
        // The lines of a write kAhead runs on, asked for now: scattered runs are bound by
        // memory latency, not bandwidth.
        if (runs.end() - it > kAhead && (it + kAhead)->first < s1) {
          const uint64_t ahead = (it + kAhead)->first;
          visitor.Ahead(op, r, eb + (ahead > s0 ? (ahead - s0) / step : 0),
                        static_cast<uint64_t>(it + kAhead - runs.begin()));
        }
        const uint64_t lo = it->first > s0 ? it->first - s0 : 0;
        const uint64_t hi = std::min(it->second, s1) - s0;
        const uint64_t first = eb + (lo < se ? 0 : (lo - se + step) / step);
        const uint64_t last = eb + std::min(count, (hi - 1) / step + 1);
        if (first >= last) continue;
        if (have && pending.row == r && pending.last >= first) {
          pending.last = std::max(pending.last, last);
          continue;
        }
        if (have && !visitor.Write(pending)) return;
        pending = {k, r, first, last, static_cast<uint64_t>(it - runs.begin())};
        have = true;
      }
    }
    if (have && !visitor.Write(pending)) return;
  }
}

}  // namespace refit::sparse
