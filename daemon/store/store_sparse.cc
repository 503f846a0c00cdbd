// Sparse Apply: when every destination of an Apply holds version P entirely (its
// applied_version) and version N was diffed against P as it completed, Apply(N) writes only the
// destination elements whose source bytes changed, through the same plan (so resharding, fused
// and strided layouts and dtype conversion are the full Apply's), undo-journaled and verified.
// docs/architecture.md, "Sparse Apply".

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/plan.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/sparse_walk.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

using sparse::CopyBytes;
using sparse::DstAt;
using sparse::ForEachWrite;
using sparse::kCheckEvery;
using sparse::Landed;
using sparse::ParallelFor;
using sparse::PlainOp;
using sparse::SameBytes;
using sparse::SparseWrite;
using sparse::SplitOps;
using sparse::SrcAt;
using sparse::WorkItem;

// Pass one: what the sparse Apply will write, and the journal room its undo records take.
struct SparseSizer {
  const plan::Plan& plan;
  uint64_t writes = 0, written = 0, record_bytes = 0;
  void Ahead(const plan::CopyOp&, uint64_t, uint64_t, uint64_t) {}
  bool Write(const SparseWrite& w) {
    const plan::CopyOp& op = plan.ops[w.op];
    const uint64_t de = DTypeSize(op.dst_dtype);
    const uint64_t n = w.last - w.first;
    ++writes;
    written += n * de;
    if (op.dst_stride == 1) {
      const uint64_t bytes = n * de, max = ApplyJournal::Entry::kMaxRecordBytes;
      record_bytes += bytes / max * ApplyJournal::Entry::RecordBytes(max);
      if (bytes % max) record_bytes += ApplyJournal::Entry::RecordBytes(bytes % max);
    } else {
      record_bytes += n * ApplyJournal::Entry::RecordBytes(de);
    }
    return true;
  }
};

// Pass two, one pass per write while its lines are in cache: the destination still holds the
// base version there (else stop: the full copy runs), its bytes saved in the undo record, the
// new bytes written and checked. Plain ops take the new bytes from the change list (read in
// order); only the destination (and every kCheckEvery-th run's bytes of N-1) is scattered.
struct SparseWriter {
  const plan::Plan& plan;
  const std::vector<const uint8_t*>& base;     // the held version's pieces
  const std::vector<const uint8_t*>& src;      // the new version's pieces
  const std::vector<const ChangeList*>& list;  // their change lists
  const std::vector<uint8_t*>& dst;
  ApplyJournal::Part& undo;    // this worker's part of the undo record
  std::atomic<bool>& stopped;  // another worker stopped: stop too
  uint64_t kill_at = 0;
  bool from_slot = false;  // REFIT_TEST_SPARSE_FROM_SLOT (test build): the new bytes not carried
  // REFIT_TEST_APPLY_UNVERIFIED (test build): what was written is not compared with the version
  // (the base check stays: it decides whether the sparse path may run at all), for a benchmark
  // that puts the verified sparse Apply beside the plain one.
  bool unverified = false;
  uint64_t done = 0;
  uint32_t last_op = UINT32_MAX;
  bool flip = false;          // REFIT_FAULT_APPLY_FLIP (test build): the first write's byte changes
  bool not_base = false;      // the destination did not hold the base version: stopped
  bool journal_full = false;  // (cannot happen: pass one sized it) stopped
  uint32_t not_base_op = 0;
  std::vector<size_t> bad = {};  // ops whose bytes did not land
  std::vector<uint8_t> scratch = {};

  void Ahead(const plan::CopyOp& op, uint64_t row, uint64_t element, uint64_t run) {
    if (element >= op.count) return;
    if (!PlainOp(op)) __builtin_prefetch(src[op.src_location] + SrcAt(op, row, element), 0);
    if (run % kCheckEvery == 0) {
      __builtin_prefetch(base[op.src_location] + SrcAt(op, row, element), 0);
    }
    __builtin_prefetch(dst[op.dst_location] + DstAt(op, row, element), 1);
  }

  bool Write(const SparseWrite& w) {
    if (done % 256 == 0 && stopped.load(std::memory_order_relaxed)) return false;
    const plan::CopyOp& op = plan.ops[w.op];
    const uint64_t n = w.last - w.first;
    const uint64_t at = DstAt(op, w.row, w.first);
    uint8_t* to = dst[op.dst_location] + at;
    // Whatever the destination holds where this step writes is overwritten with N: the check
    // only tells a buffer the engine wrote into since (a bulk overwrite) from one that holds
    // N-1, so the writes from every kCheckEvery-th change run and each op's first are checked,
    // not each (the bytes of N-1 are another stream of scattered reads).
    const bool check = w.run % kCheckEvery == 0 || w.op != last_op;
    last_op = w.op;
    if (PlainOp(op)) {
      const uint64_t bytes = n * DTypeSize(op.dst_dtype);
      const uint64_t from = SrcAt(op, w.row, w.first);
      const uint8_t* value =
          from_slot ? nullptr : list[op.src_location]->Values(w.run, from, bytes);
      if (!value) value = src[op.src_location] + from;  // a write past its run's words
      if (check && !SameBytes(to, base[op.src_location] + from, bytes)) return Stop(w.op);
      if (!undo.Save(op.dst_location, at, to, bytes)) return Full();
      CopyBytes(to, value, bytes);
      if (flip && done == 0) *to ^= 0x5a;  // test build: a byte changes under the write
      if (!unverified && !SameBytes(to, value, bytes)) bad.push_back(w.op);
    } else {
      if (check && !Landed(op, w, base[op.src_location], dst[op.dst_location], &scratch)) {
        return Stop(w.op);
      }
      const uint64_t de = DTypeSize(op.dst_dtype);
      if (op.dst_stride == 1) {
        if (!undo.Save(op.dst_location, at, to, n * de)) return Full();
      } else {
        const uint64_t stride = static_cast<uint64_t>(op.dst_stride) * de;
        for (uint64_t e = 0; e < n; ++e) {
          if (!undo.Save(op.dst_location, at + e * stride, to + e * stride, de)) return Full();
        }
      }
      plan::ConvertRun(src[op.src_location] + SrcAt(op, w.row, w.first), op.src_dtype,
                       op.src_stride, to, op.dst_dtype, op.dst_stride, n);
      if (!unverified && !Landed(op, w, src[op.src_location], dst[op.dst_location], &scratch)) {
        bad.push_back(w.op);
      }
    }
    if (++done == kill_at) TestHookKillAt("apply");  // test build: a commit point
    return true;
  }
  bool Stop(uint32_t op) {
    not_base = true;
    not_base_op = op;
    stopped.store(true);
    return false;
  }
  bool Full() {
    journal_full = true;
    stopped.store(true);
    return false;
  }
};

}  // namespace

bool TakeSparseFlip() {
  // Test build only: a destination byte changes under the first write, in the first N sparse
  // Applies (as plan::ExecuteAndVerifyOnHost does for the full one).
  static std::atomic<long> flips{-1};
  if (flips.load() < 0) {
    const char* n = TestSwitch("REFIT_FAULT_APPLY_FLIP");
    long expected = -1;
    flips.compare_exchange_strong(expected, n ? std::atol(n) : 0);
  }
  return flips.load() > 0 && flips-- > 0;
}

unsigned SparseThreadsWanted(const StoreOptions& options) {
  static const char* forced = TestSwitch("REFIT_TEST_SPARSE_THREADS");
  return forced ? static_cast<unsigned>(std::atoi(forced)) : options.sparse_threads;
}

std::optional<absl::Status> Store::EndSparse(const Version& version, uint64_t base,
                                             const plan::Plan& plan,
                                             const std::vector<std::shared_ptr<Buffer>>& dests,
                                             ApplyJournal::Entry& undo, SparseEnd end) {
  if (end.not_base_op) {
    // An engine that wrote into its buffer since (a bulk overwrite always shows here): what
    // this pass wrote goes back, and the full copy runs.
    undo.Restore();
    Logger("store")->info(
        "Apply of version {} into {}: it does not hold version {} where this step writes "
        "(written since?): full copy",
        version.number, dests[plan.ops[*end.not_base_op].dst_location]->id, base);
    return std::nullopt;
  }
  if (!end.bad.empty()) {
    std::sort(end.bad.begin(), end.bad.end());
    end.bad.erase(std::unique(end.bad.begin(), end.bad.end()), end.bad.end());
    undo.Restore();
    return NotLanded(version, plan, end.bad, dests, /*restored=*/true);
  }
  for (const auto& d : dests) {
    if (!d->region->Broken()) continue;
    std::vector<bool> gone;
    for (const auto& other : dests) gone.push_back(other->region->Broken());
    undo.Restore(gone);
    return MemoryWentAway(*d, " (the other destination buffers were put back as they were)");
  }
  undo.Commit();
  return absl::OkStatus();
}

std::optional<Store::SparseInputs> Store::SparseInputsFor(
    const Version& version, const Version& held, const CachedPlan& cached, size_t dests,
    const std::vector<std::shared_ptr<Region>>& derived) {
  if (version.pieces.empty()) return std::nullopt;
  if (held.layout_key != version.layout_key || held.pieces.size() != version.pieces.size()) {
    return std::nullopt;
  }
  const plan::Plan& plan = cached.plan;
  // Per source location of the plan (the pieces, then the derived slot of fp8 destinations with
  // scales): its change list, its new bytes and the held version's bytes, where it has them.
  const size_t pieces = version.pieces.size();
  const size_t locations = pieces + (cached.jobs.empty() ? 0 : 1);
  SparseInputs in;
  in.changes.assign(locations, nullptr);
  in.base.assign(locations, nullptr);
  in.src.assign(locations, nullptr);
  std::vector<uint64_t> base_of(locations, 0), compared_of(locations, 0);
  for (size_t i = 0; i < pieces; ++i) {
    const Piece& p = held.pieces[i];
    const Piece& n = version.pieces[i];
    if (!n.changes || !n.slot || !p.slot || p.released || p.slot->kind() != MemoryKind::kHost ||
        n.slot->kind() != MemoryKind::kHost || p.slot->size() != n.slot->size() ||
        (p.valid && (!n.valid || *p.valid != *n.valid))) {
      continue;
    }
    in.changes[i] = n.changes.get();
    in.src[i] = n.slot->data();
    in.base[i] = p.slot->data();
    base_of[i] = n.changes_base;
    compared_of[i] = n.compared_bytes;
  }
  // fp8 destinations with scales: the change list of the derived slot, diffed against the held
  // version's slot of the same batch as the quantizer finished it (DiffDerived). Both slots are
  // kept by their versions' QuantCache while the caller holds the versions.
  if (!cached.jobs.empty()) {
    if (derived.size() != 1 || !derived[0] || derived[0]->kind() != MemoryKind::kHost) {
      return std::nullopt;
    }
    DerivedChanges derived_changes = version.quant->Changes(cached.batch.get());
    in.held_derived = held.quant->Slot(cached.batch.get());
    if (derived_changes.list && in.held_derived && in.held_derived->kind() == MemoryKind::kHost &&
        in.held_derived->size() == derived[0]->size()) {
      in.derived_changes = derived_changes.list;
      in.changes[pieces] = derived_changes.list.get();
      in.src[pieces] = derived[0]->data();
      in.base[pieces] = in.held_derived->data();
      base_of[pieces] = derived_changes.base;
      compared_of[pieces] = derived_changes.compared;
    }
  }
  // Every location the plan reads diffed against the version every destination holds entirely.
  std::vector<bool> read(locations, false);
  for (const plan::CopyOp& op : plan.ops) {
    if (op.src_location >= locations || op.dst_location >= dests) return std::nullopt;
    read[op.src_location] = true;
  }
  for (size_t l = 0; l < locations; ++l) {
    if (!read[l]) continue;
    if (!in.changes[l] || base_of[l] != held.number) return std::nullopt;
    in.changed += in.changes[l]->changed_bytes;
    in.compared += compared_of[l];
    in.runs += in.changes[l]->runs.size();
  }
  return in;
}

std::optional<absl::StatusOr<ApplyResult>> Store::ApplySparse(
    const Version& version, const std::shared_ptr<const Version>& held, const CachedPlan& cached,
    const std::vector<std::shared_ptr<Buffer>>& dests,
    const std::vector<std::shared_ptr<Region>>& derived, const PreparedSparse* prepared) {
  if (!held) return std::nullopt;
  const uint64_t base = held->number;
  if (prepared) {
    // The writes collected as the version completed: the pause is the writing alone.
    bool full_copy = false;
    if (auto applied = ApplyPrepared(version, *held, cached, dests, *prepared, &full_copy)) {
      return applied;
    }
    if (full_copy) return std::nullopt;
  }
  std::optional<SparseInputs> inputs =
      SparseInputsFor(version, *held, cached, dests.size(), derived);
  if (!inputs) return std::nullopt;
  const plan::Plan& plan = cached.plan;
  const std::vector<const ChangeList*>& changes = inputs->changes;
  const std::vector<const uint8_t*>& old_bytes = inputs->base;
  const std::vector<const uint8_t*>& src = inputs->src;
  const uint64_t runs = inputs->runs;
  // GPU destinations (and, with the test seam, host ones) take the run-list path: the writes
  // collected as byte runs for a RunWriter (store_sparse_runs.cc).
  bool run_list = options_.sparse_run_writers != nullptr;
  for (const auto& d : dests) {
    if (d->applied != base) return std::nullopt;
    run_list = run_list || d->region->kind() != MemoryKind::kHost;
  }
  if (inputs->changed * kDenseShareInverse > inputs->compared) {
    return std::nullopt;  // dense: a copy is cheaper
  }
  // Fewer changed runs than the cost model allows, or the full copy is cheaper.
  static const bool always = TestSwitch("REFIT_TEST_SPARSE_ALWAYS") != nullptr;
  const uint64_t per_run =
      run_list ? options_.gpu_sparse_bytes_per_run : options_.sparse_bytes_per_run;
  if (!always && per_run > 0 && runs * per_run >= cached.plan.dst_bytes) return std::nullopt;
  if (run_list) {
    const auto t_start = Clock::now();
    const double cpu_start = ProcessCpuSeconds();
    const unsigned threads = sparse::ThreadsFor(runs, SparseThreadsWanted(options_));
    const std::vector<sparse::RunList> lists =
        sparse::CollectRuns(plan, inputs->sources(), dests.size(), threads);
    return ApplySparseRuns(
        version, base, plan, lists,
        absl::StrCat("collected on ", threads, " thread(s) in ",
                     absl::SixDigits(
                         std::chrono::duration<double, std::milli>(Clock::now() - t_start).count()),
                     " ms (", absl::SixDigits((ProcessCpuSeconds() - cpu_start) * 1e3), " ms CPU)"),
        dests);
  }
  const auto t_start = Clock::now();
  // The work cut into items of rows, sized (pass one) and written (pass two) on several cores
  // when there are enough runs: each worker takes a contiguous share of the items, with a part
  // of the undo record of its own.
  const std::vector<WorkItem> items = SplitOps(plan, changes);
  const unsigned threads =
      std::min<unsigned>(sparse::ThreadsFor(runs, SparseThreadsWanted(options_)),
                         static_cast<unsigned>(std::max<size_t>(1, items.size())));
  std::vector<SparseSizer> sized(items.size(), SparseSizer{plan});
  {
    std::atomic<size_t> next{0};
    ParallelFor(threads, [&](unsigned) {
      for (size_t i = next++; i < items.size(); i = next++) {
        ForEachWrite(plan, changes, &items[i], &items[i] + 1, sized[i]);
      }
    });
  }
  SparseSizer sizer{plan};
  for (const SparseSizer& s : sized) {
    sizer.writes += s.writes;
    sizer.written += s.written;
    sizer.record_bytes += s.record_bytes;
  }
  // Worker w: items [cut[w], cut[w + 1]), about sizer.writes / threads writes.
  std::vector<size_t> cut(threads + 1, items.size());
  std::vector<uint64_t> capacities(threads, 0), writes(threads, 0);
  cut[0] = 0;
  {
    unsigned w = 0;
    uint64_t acc = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      while (w + 1 < threads && acc >= sizer.writes * (w + 1) / threads) cut[++w] = i;
      acc += sized[i].writes;
      capacities[w] += sized[i].record_bytes;
      writes[w] += sized[i].writes;
    }
    while (w + 1 < threads) cut[++w] = items.size();
  }
  const auto t_planned = Clock::now();
  // The undo record: the destination bytes of every write, saved as it is made.
  std::vector<UndoTarget> targets;
  for (const auto& d : dests) {
    UndoTarget t;
    t.identity = d->memory;
    t.data = d->region->data();
    t.size = d->region->size();
    t.prev_version = d->applied;
    t.version = version.number;
    targets.push_back(std::move(t));
  }
  auto undo = journal_->BeginSparse(std::move(targets), capacities);
  if (undo.status().code() == absl::StatusCode::kInvalidArgument) return std::nullopt;
  if (!undo.ok()) return absl::StatusOr<ApplyResult>(undo.status());
  std::vector<uint8_t*> dst;
  for (const auto& d : dests) dst.push_back(d->region->data());
  std::atomic<bool> stopped{false};
  std::vector<SparseWriter> writers;
  writers.reserve(threads);
  for (unsigned w = 0; w < threads; ++w) {
    writers.push_back(SparseWriter{plan, old_bytes, src, changes, dst, (*undo)->part(w), stopped});
  }
  static const bool from_slot = TestSwitch("REFIT_TEST_SPARSE_FROM_SLOT") != nullptr;
  static const bool unverified = TestSwitch("REFIT_TEST_APPLY_UNVERIFIED") != nullptr;
  for (SparseWriter& w : writers) {
    w.from_slot = from_slot;
    w.unverified = unverified;
  }
  // Test build: killed half-way through the busiest worker's writes (the others mid-way too).
  const unsigned busiest =
      static_cast<unsigned>(std::max_element(writes.begin(), writes.end()) - writes.begin());
  writers[busiest].kill_at = std::max<uint64_t>(1, writes[busiest] / 2);
  SparseWriter& writer = writers[busiest];
  writer.flip = TakeSparseFlip();
  ParallelFor(threads, [&](unsigned w) {
    ForEachWrite(plan, changes, items.data() + cut[w], items.data() + cut[w + 1], writers[w]);
  });
  SparseEnd end;
  for (const SparseWriter& w : writers) {
    if ((w.not_base || w.journal_full) && !end.not_base_op) end.not_base_op = w.not_base_op;
    end.bad.insert(end.bad.end(), w.bad.begin(), w.bad.end());
  }
  const uint64_t undo_bytes = (*undo)->undo_bytes();
  std::optional<absl::Status> ended = EndSparse(version, base, plan, dests, **undo, std::move(end));
  if (!ended) return std::nullopt;
  if (!ended->ok()) return absl::StatusOr<ApplyResult>(*ended);
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  Logger("store")->debug(
      "sparse Apply of version {}: {} runs, {} bytes, {} thread(s): planned {:.1f} ms, checked, "
      "saved, written and verified {:.1f} ms",
      version.number, sizer.writes, sizer.written, threads, ms(t_start, t_planned),
      ms(t_planned, Clock::now()));
  return absl::StatusOr<ApplyResult>(ApplyResult{version.number, sizer.written, undo_bytes, true});
}

}  // namespace refit
