// The run lists of a sparse Apply (sparse_runs.h): the walk of sparse_walk.h with a visitor that
// collects instead of writing. docs/architecture.md, "Sparse Apply".

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/plan/dtype_convert.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/sparse_runs.h"

namespace refit::sparse {
namespace {

// The visitor of ForEachWrite that collects instead of writing: each write's new bytes (from
// the change list where it carries them, else converted from the new version's slot, as the host
// sparse Apply writes them), one run for a contiguous write or one per element for a strided
// destination, and, for every kCheckEvery-th change run's write and each op's first, the base's
// bytes there (what the destination must hold: else the full copy runs).
class RunCollector {
 public:
  RunCollector(const plan::Plan& plan, const Sources& sources, std::vector<RunList>* lists,
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
  const Sources& sources_;
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

}  // namespace

std::vector<RunList> CollectRuns(const plan::Plan& plan, const Sources& sources, size_t dests,
                                 unsigned threads, bool merged, std::vector<RunList>* recycle) {
  const std::vector<WorkItem> items = SplitOps(plan, sources.changes);
  const size_t chunks = std::max<size_t>(1, std::min<size_t>(items.size(), threads * 4u));
  std::vector<std::vector<RunList>> parts(chunks, std::vector<RunList>(dests));
  for (std::vector<RunList>& part : parts) {
    for (size_t j = 0; j < dests; ++j) {
      if (recycle && !recycle->empty()) {
        part[j] = std::move(recycle->back());
        recycle->pop_back();
        part[j].runs.clear();
        part[j].ops.clear();
        part[j].values.clear();
        part[j].checks.clear();
        part[j].expected.clear();
      }
      part[j].dest = static_cast<uint32_t>(j);
    }
  }
  std::atomic<size_t> next{0};
  ParallelFor(std::min<unsigned>(threads, static_cast<unsigned>(chunks)), [&](unsigned) {
    for (size_t c = next++; c < chunks; c = next++) {
      RunCollector collector(plan, sources, &parts[c], sources.runs / chunks + 16);
      ForEachWrite(plan, sources.changes, items.data() + items.size() * c / chunks,
                   items.data() + items.size() * (c + 1) / chunks, collector);
    }
  });
  if (!merged) {
    std::vector<RunList> lists;
    for (std::vector<RunList>& part : parts) {
      for (RunList& list : part) {
        if (!list.runs.empty()) lists.push_back(std::move(list));
      }
    }
    return lists;
  }
  if (chunks == 1) return std::move(parts[0]);
  std::vector<RunList> lists(dests);
  for (size_t j = 0; j < dests; ++j) lists[j].dest = static_cast<uint32_t>(j);
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

HostCuts CutRuns(const std::vector<RunList>& lists, unsigned threads) {
  threads = std::max(1u, threads);
  HostCuts cuts;
  cuts.workers.resize(threads);
  cuts.capacities.assign(threads, 0);
  cuts.runs.assign(threads, 0);
  uint64_t total = 0;
  for (const RunList& list : lists) total += list.runs.size();
  uint64_t at = 0;  // runs of the lists before this one
  for (uint32_t j = 0; j < lists.size(); ++j) {
    const RunList& list = lists[j];
    const uint64_t n = list.runs.size();
    // The checks' bytes in `expected` before each check.
    std::vector<uint64_t> expected_at(list.checks.size() + 1, 0);
    for (size_t c = 0; c < list.checks.size(); ++c) {
      expected_at[c + 1] = expected_at[c] + list.checks[c].second;
    }
    for (unsigned w = 0; w < threads; ++w) {
      const uint64_t lo = total * w / threads, hi = total * (w + 1) / threads;
      const uint64_t begin = std::max(lo, at), end = std::min(hi, at + n);
      if (begin >= end) continue;
      Segment segment;
      segment.list = j;
      segment.begin = begin - at;
      segment.end = end - at;
      const uint64_t first_value = list.runs[segment.begin].value_offset;
      segment.check = static_cast<size_t>(
          std::partition_point(list.checks.begin(), list.checks.end(),
                               [&](const std::pair<uint64_t, uint64_t>& check) {
                                 return check.first + check.second <= first_value;
                               }) -
          list.checks.begin());
      segment.expected = expected_at[segment.check];
      const auto op = std::partition_point(list.ops.begin(), list.ops.end(),
                                           [&](const std::pair<uint64_t, uint32_t>& stretch) {
                                             return stretch.first <= segment.begin;
                                           });
      segment.op = op == list.ops.begin() ? 0 : static_cast<size_t>(op - list.ops.begin()) - 1;
      constexpr uint64_t kMax = ApplyJournal::Entry::kMaxRecordBytes;
      for (uint64_t r = segment.begin; r < segment.end; ++r) {
        const uint64_t bytes = list.runs[r].bytes;
        cuts.capacities[w] += bytes / kMax * ApplyJournal::Entry::RecordBytes(kMax);
        if (bytes % kMax) cuts.capacities[w] += ApplyJournal::Entry::RecordBytes(bytes % kMax);
      }
      cuts.runs[w] += segment.end - segment.begin;
      cuts.workers[w].push_back(segment);
    }
    at += n;
  }
  return cuts;
}

unsigned ThreadsFor(uint64_t runs, unsigned wanted) {
  if (wanted > 0) return wanted;
  if (runs < kParallelRuns) return 1;
  return std::min(std::max(1u, std::thread::hardware_concurrency()), kMaxThreads);
}

}  // namespace refit::sparse
