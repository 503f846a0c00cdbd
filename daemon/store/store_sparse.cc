// Sparse Apply: when every destination of an Apply holds version P entirely (its
// applied_version) and version N was diffed against P as it completed, Apply(N) writes only the
// destination elements whose source bytes changed, through the same plan (so resharding, fused
// and strided layouts and dtype conversion are the full Apply's), undo-journaled and verified.
// docs/architecture.md, "Sparse Apply".

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/plan/convert.h"
#include "daemon/plan/plan.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

constexpr uint64_t kDiffTaskBytes = 4 << 20;
// Past this share of changed bytes a sparse Apply is not worth it: the full copy runs.
constexpr uint64_t kDenseShareInverse = 8;  // 12.5 %

uint64_t Load(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

void AddRun(ByteRanges* runs, uint64_t begin, uint64_t end) {
  if (!runs->empty() && runs->back().second >= begin) {
    runs->back().second = std::max(runs->back().second, end);
  } else {
    runs->emplace_back(begin, end);
  }
}

// The runs of [begin, end) where `a` and `b` differ.
void DiffRange(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, ByteRanges* out) {
  uint64_t i = begin;
  for (; i < end && i % 8 != 0; ++i) {
    if (a[i] != b[i]) AddRun(out, i, i + 1);
  }
  auto word = [&](uint64_t at) {
    const uint64_t x = Load(a + at) ^ Load(b + at);
    if (x == 0) return;
    const uint64_t lo = static_cast<uint64_t>(__builtin_ctzll(x)) / 8;
    const uint64_t hi = 7 - static_cast<uint64_t>(__builtin_clzll(x)) / 8;
    AddRun(out, at + lo, at + hi + 1);
  };
  for (; i + 64 <= end; i += 64) {
    uint64_t any = 0;
    for (uint64_t k = 0; k < 64; k += 8) any |= Load(a + i + k) ^ Load(b + i + k);
    if (any == 0) continue;
    for (uint64_t k = 0; k < 64; k += 8) word(i + k);
  }
  for (; i + 8 <= end; i += 8) word(i);
  for (; i < end; ++i) {
    if (a[i] != b[i]) AddRun(out, i, i + 1);
  }
}

// One element run of an op that the sparse Apply writes: elements [first, last) of `row`.
struct SparseWrite {
  uint32_t op = 0;
  uint64_t row = 0;
  uint64_t first = 0;
  uint64_t last = 0;
};

uint64_t SrcAt(const plan::CopyOp& op, uint64_t row, uint64_t element) {
  const uint64_t elem = DTypeSize(op.src_dtype);
  return op.src_offset + (row * static_cast<uint64_t>(op.src_row_stride) +
                          element * static_cast<uint64_t>(op.src_stride)) *
                             elem;
}

uint64_t DstAt(const plan::CopyOp& op, uint64_t row, uint64_t element) {
  const uint64_t elem = DTypeSize(op.dst_dtype);
  return op.dst_offset + (row * static_cast<uint64_t>(op.dst_row_stride) +
                          element * static_cast<uint64_t>(op.dst_stride)) *
                             elem;
}

// True when what `w` wrote at `dst` is what the plan says (the source converted).
bool Landed(const plan::CopyOp& op, const SparseWrite& w, const uint8_t* src, const uint8_t* dst,
            std::vector<uint8_t>* scratch) {
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

}  // namespace

void Store::DiffPieces(std::vector<Piece*> pieces, const Version& base) {
  struct Task {
    size_t piece;
    const uint8_t* old_bytes;
    uint64_t begin, end;
  };
  std::vector<Task> tasks;
  std::vector<size_t> first_task(pieces.size() + 1, 0);
  std::vector<bool> diffed(pieces.size(), false);
  for (size_t i = 0; i < pieces.size(); ++i) {
    first_task[i] = tasks.size();
    Piece& piece = *pieces[i];
    piece.changes.reset();
    const Piece* old = nullptr;
    for (const Piece& b : base.pieces) {
      if (b.node == piece.node && b.buffer_id == piece.buffer_id) old = &b;
    }
    if (!old || !old->slot || old->released || !piece.slot ||
        piece.slot->kind() != MemoryKind::kHost || old->slot->kind() != MemoryKind::kHost ||
        old->slot->size() != piece.slot->size()) {
      continue;
    }
    ByteRanges whole{{0, piece.slot->size()}};
    const ByteRanges& ranges = piece.valid ? *piece.valid : whole;
    // Every byte compared must be held of the old piece.
    if (old->valid && *old->valid != ranges) continue;
    diffed[i] = true;
    for (const auto& [b, e] : ranges) {
      for (uint64_t at = b; at < e; at += kDiffTaskBytes) {
        tasks.push_back({i, old->slot->data(), at, std::min(e, at + kDiffTaskBytes)});
      }
    }
  }
  first_task[pieces.size()] = tasks.size();
  std::vector<ByteRanges> found(tasks.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t t = next++; t < tasks.size(); t = next++) {
      const Task& task = tasks[t];
      DiffRange(pieces[task.piece]->slot->data(), task.old_bytes, task.begin, task.end, &found[t]);
    }
  };
  uint64_t total = 0;
  for (const Task& t : tasks) total += t.end - t.begin;
  const unsigned threads =
      total < (16u << 20) ? 1u
                          : std::min<unsigned>({std::max(1u, std::thread::hardware_concurrency()),
                                                8u, static_cast<unsigned>(tasks.size())});
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!diffed[i]) continue;
    auto runs = std::make_shared<ChangeRuns>();
    uint64_t compared = 0;
    for (size_t t = first_task[i]; t < first_task[i + 1]; ++t) {
      for (const auto& [b, e] : found[t]) AddRun(runs.get(), b, e);
      compared += tasks[t].end - tasks[t].begin;
    }
    pieces[i]->changes = std::move(runs);
    pieces[i]->changes_base = base.number;
    pieces[i]->compared_bytes = compared;
  }
}

std::shared_ptr<const Store::Version> Store::DiffBaseFor(const Model& model) const {
  if (model.destinations.empty() || model.latest == 0) return nullptr;
  auto it = model.complete.find(model.latest);
  return it == model.complete.end() ? nullptr : it->second;
}

std::optional<absl::StatusOr<ApplyResult>> Store::ApplySparse(
    const Version& version, const std::shared_ptr<const Version>& held, const CachedPlan& cached,
    const std::vector<std::shared_ptr<Buffer>>& dests) {
  if (!cached.jobs.empty() || version.pieces.empty() || !held) return std::nullopt;
  if (held->layout_key != version.layout_key || held->pieces.size() != version.pieces.size()) {
    return std::nullopt;
  }
  // Every piece diffed against the version every destination holds entirely.
  const uint64_t base = version.pieces[0].changes_base;
  uint64_t changed = 0, compared = 0;
  for (const Piece& piece : version.pieces) {
    if (!piece.changes || piece.changes_base != base || !piece.slot) return std::nullopt;
    for (const auto& [b, e] : *piece.changes) changed += e - b;
    compared += piece.compared_bytes;
  }
  if (held->number != base) return std::nullopt;
  for (size_t i = 0; i < held->pieces.size(); ++i) {
    const Piece& p = held->pieces[i];
    const Piece& n = version.pieces[i];
    if (!p.slot || p.released || p.slot->kind() != MemoryKind::kHost ||
        p.slot->size() != n.slot->size() || (p.valid && (!n.valid || *p.valid != *n.valid))) {
      return std::nullopt;
    }
  }
  for (const auto& d : dests) {
    if (d->applied != base || d->region->kind() != MemoryKind::kHost) return std::nullopt;
  }
  if (changed * kDenseShareInverse > compared) return std::nullopt;  // dense: a copy is cheaper
  // Fewer changed runs than the cost model allows, or the full copy is cheaper.
  static const bool always = TestSwitch("REFIT_TEST_SPARSE_ALWAYS") != nullptr;
  uint64_t runs = 0;
  for (const Piece& piece : version.pieces) runs += piece.changes->size();
  if (!always && options_.sparse_bytes_per_run > 0 &&
      runs * options_.sparse_bytes_per_run >= cached.plan.dst_bytes) {
    return std::nullopt;
  }
  const plan::Plan& plan = cached.plan;
  const auto t_start = Clock::now();
  std::vector<SparseWrite> writes;
  for (uint32_t k = 0; k < plan.ops.size(); ++k) {
    const plan::CopyOp& op = plan.ops[k];
    if (op.src_location >= version.pieces.size()) return std::nullopt;
    const ByteRanges& runs = *version.pieces[op.src_location].changes;
    if (runs.empty() || op.count == 0) continue;
    const uint64_t se = DTypeSize(op.src_dtype);
    const uint64_t step = static_cast<uint64_t>(op.src_stride) * se;
    for (uint64_t r = 0; r < op.rows; ++r) {
      const uint64_t s0 = SrcAt(op, r, 0);
      const uint64_t s1 = s0 + (op.count - 1) * step + se;
      auto it = std::upper_bound(
          runs.begin(), runs.end(), s0,
          [](uint64_t at, const std::pair<uint64_t, uint64_t>& run) { return at < run.second; });
      for (; it != runs.end() && it->first < s1; ++it) {
        const uint64_t lo = it->first > s0 ? it->first - s0 : 0;
        const uint64_t hi = std::min(it->second, s1) - s0;
        const uint64_t first = lo < se ? 0 : (lo - se + step) / step;
        const uint64_t last = std::min(op.count, (hi - 1) / step + 1);
        if (first >= last) continue;
        if (!writes.empty() && writes.back().op == k && writes.back().row == r &&
            writes.back().last >= first) {
          writes.back().last = std::max(writes.back().last, last);
        } else {
          writes.push_back({k, r, first, last});
        }
      }
    }
  }
  // The undo record: the destination bytes of every write.
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
  uint64_t written = 0;
  for (const SparseWrite& w : writes) {
    const plan::CopyOp& op = plan.ops[w.op];
    const uint64_t de = DTypeSize(op.dst_dtype);
    targets[op.dst_location].ranges.emplace_back(DstAt(op, w.row, w.first),
                                                 DstAt(op, w.row, w.last - 1) + de);
    written += (w.last - w.first) * de;
  }
  for (UndoTarget& t : targets) MergeRanges(&t.ranges);
  const auto t_planned = Clock::now();
  // The destinations must still hold the held version where this Apply writes: an engine that
  // wrote into its buffer since (a bulk overwrite always shows here) gets the full copy.
  {
    std::vector<uint8_t> scratch;
    for (const SparseWrite& w : writes) {
      const plan::CopyOp& op = plan.ops[w.op];
      if (!Landed(op, w, held->pieces[op.src_location].slot->data(),
                  dests[op.dst_location]->region->data(), &scratch)) {
        Logger("store")->info(
            "Apply of version {} into {}: it does not hold version {} where this step writes "
            "(written since?): full copy",
            version.number, dests[op.dst_location]->id, base);
        return std::nullopt;
      }
    }
  }
  const auto t_checked = Clock::now();
  auto undo = journal_->Begin(std::move(targets));
  if (!undo.ok()) return absl::StatusOr<ApplyResult>(undo.status());
  const auto t_saved = Clock::now();

  std::vector<const uint8_t*> src;
  for (const Piece& piece : version.pieces) src.push_back(piece.slot->data());
  std::vector<uint8_t*> dst;
  for (const auto& d : dests) dst.push_back(d->region->data());
  std::vector<size_t> bad;
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < writes.size(); ++i) {
    const SparseWrite& w = writes[i];
    const plan::CopyOp& op = plan.ops[w.op];
    plan::ConvertRun(src[op.src_location] + SrcAt(op, w.row, w.first), op.src_dtype, op.src_stride,
                     dst[op.dst_location] + DstAt(op, w.row, w.first), op.dst_dtype, op.dst_stride,
                     w.last - w.first);
    if (i == writes.size() / 2) TestHookKillAt("apply");  // test build: a commit point
    if (!Landed(op, w, src[op.src_location], dst[op.dst_location], &scratch)) bad.push_back(w.op);
  }
  if (!bad.empty()) {
    std::sort(bad.begin(), bad.end());
    bad.erase(std::unique(bad.begin(), bad.end()), bad.end());
    (*undo)->Restore();
    return absl::StatusOr<ApplyResult>(NotLanded(version, plan, bad, dests, /*restored=*/true));
  }
  for (const auto& d : dests) {
    if (!d->region->Broken()) continue;
    std::vector<bool> gone;
    for (const auto& other : dests) gone.push_back(other->region->Broken());
    (*undo)->Restore(gone);
    return absl::StatusOr<ApplyResult>(
        MemoryWentAway(*d, " (the other destination buffers were put back as they were)"));
  }
  const uint64_t undo_bytes = (*undo)->undo_bytes();
  (*undo)->Commit();
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  Logger("store")->debug(
      "sparse Apply of version {}: {} runs, {} bytes: planned {:.1f} ms, checked {:.1f} ms, "
      "saved {:.1f} ms, written {:.1f} ms",
      version.number, writes.size(), written, ms(t_start, t_planned), ms(t_planned, t_checked),
      ms(t_checked, t_saved), ms(t_saved, Clock::now()));
  return absl::StatusOr<ApplyResult>(ApplyResult{version.number, written, undo_bytes, true});
}

}  // namespace refit
