// Where a sparse Apply's change lists come from (docs/architecture.md, "Sparse Apply"): a
// version's pieces diffed against the version this node's engines hold, as they arrive
// (Publish's snapshot, FinishPull), on up to 8 cores; a pulled piece rebuilt from whole delta
// chunks takes the list its deltas gathered instead; fp8 destinations' derived slots diffed on
// their quantized bytes.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

// Small enough that the lines a task compared are still in cache when it gathers the new
// bytes of its runs.
constexpr uint64_t kDiffTaskBytes = 1 << 20;

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

// What one diff task found: its runs and the new bytes of their words (ChangeList).
struct Found {
  ByteRanges runs;
  std::vector<uint64_t> at;  // per run: where its words start in `values`
  std::vector<uint8_t> values;
};

// Copies the new bytes of each of `found`'s runs' words out of `data` (`size` bytes), right
// after DiffRange read those lines.
void GatherValues(const uint8_t* data, uint64_t size, Found* found) {
  uint64_t total = 0;
  for (const auto& [b, e] : found->runs) {
    total += std::min(size, (e + 7) & ~uint64_t{7}) - (b & ~uint64_t{7});
  }
  found->at.resize(found->runs.size());
  found->values.resize(total);
  uint8_t* to = found->values.data();
  for (size_t k = 0; k < found->runs.size(); ++k) {
    const uint64_t lo = found->runs[k].first & ~uint64_t{7};
    const uint64_t hi = std::min(size, (found->runs[k].second + 7) & ~uint64_t{7});
    found->at[k] = static_cast<uint64_t>(to - found->values.data());
    if (hi - lo == 8) {
      __builtin_memcpy(to, data + lo, 8);
    } else {
      std::memcpy(to, data + lo, hi - lo);
    }
    to += hi - lo;
  }
}

}  // namespace

namespace {

// One region diffed against the bytes an earlier version held there.
struct DiffInput {
  const uint8_t* now = nullptr;
  uint64_t size = 0;  // of `now`
  const uint8_t* old = nullptr;
  ByteRanges ranges;  // the bytes compared
};

// The change list of each input and the bytes compared of each, on up to 8 cores; `*diffed`
// gets the bytes compared in all. False (no lists) when the version changed more than
// ApplySparse would ever write sparsely (a full version, not an RL step): it is not diffed to
// its end nor its new bytes carried. Every task stops once the bytes found changed pass that
// share of everything (certain), or, after a sample of at least 1/64 of it (8 MiB or more),
// twice that share of what was compared (an estimate: the tasks are taken in a strided order,
// so the first ones sample the whole input evenly). A dense verdict only costs the full copy,
// which ApplySparse would have taken anyway; on an H200 host a fully changed 1 GiB version
// spent 0.10 s of its 0.19 s publish diffing before it stopped at the certain rule alone.
bool DiffRegions(const std::vector<DiffInput>& in, std::vector<std::shared_ptr<ChangeList>>* lists,
                 std::vector<uint64_t>* compared_of, uint64_t* diffed) {
  struct Task {
    size_t input;
    uint64_t begin, end;
  };
  std::vector<Task> tasks;
  std::vector<size_t> first_task(in.size() + 1, 0);
  for (size_t i = 0; i < in.size(); ++i) {
    first_task[i] = tasks.size();
    for (const auto& [b, e] : in[i].ranges) {
      for (uint64_t at = b; at < e; at += kDiffTaskBytes) {
        tasks.push_back({i, at, std::min(e, at + kDiffTaskBytes)});
      }
    }
  }
  first_task[in.size()] = tasks.size();
  std::vector<Found> found(tasks.size());
  uint64_t total = 0;
  for (const Task& t : tasks) total += t.end - t.begin;
  // Strided: tasks 0, s, 2s, ... first (about 64 of them across everything), then 1, s + 1, ...
  std::vector<size_t> order;
  order.reserve(tasks.size());
  const size_t stride = std::max<size_t>(1, (tasks.size() + 63) / 64);
  for (size_t phase = 0; phase < stride; ++phase) {
    for (size_t t = phase; t < tasks.size(); t += stride) order.push_back(t);
  }
  const uint64_t sample = std::max<uint64_t>(total / 64, 8 * kDiffTaskBytes);
  std::atomic<uint64_t> changed_total{0}, compared_total{0};
  std::atomic<bool> dense{false};
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next++; k < order.size() && !dense; k = next++) {
      const size_t t = order[k];
      const Task& task = tasks[t];
      const DiffInput& input = in[task.input];
      DiffRange(input.now, input.old, task.begin, task.end, &found[t].runs);
      uint64_t changed = 0;
      for (const auto& [b, e] : found[t].runs) changed += e - b;
      const uint64_t changed_now = changed_total += changed;
      const uint64_t compared_now = compared_total += task.end - task.begin;
      if (changed_now * kDenseShareInverse > total ||
          (compared_now >= sample && changed_now * kDenseShareInverse > 2 * compared_now)) {
        dense = true;
        break;
      }
      GatherValues(input.now, input.size, &found[t]);
    }
  };
  const unsigned threads =
      total < (16u << 20) ? 1u
                          : std::min<unsigned>({std::max(1u, std::thread::hardware_concurrency()),
                                                8u, static_cast<unsigned>(tasks.size())});
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  *diffed = compared_total;
  if (dense) return false;
  lists->assign(in.size(), nullptr);
  compared_of->assign(in.size(), 0);
  for (size_t i = 0; i < in.size(); ++i) {
    // The tasks' runs in order (touching runs of neighbouring tasks are left apart: each
    // carries its own words).
    auto list = std::make_shared<ChangeList>();
    uint64_t compared = 0, runs = 0, values = 0;
    for (size_t t = first_task[i]; t < first_task[i + 1]; ++t) {
      runs += found[t].runs.size();
      values += found[t].values.size();
    }
    list->runs.reserve(runs);
    list->values_at.reserve(runs + 1);
    list->values.reserve(values);
    for (size_t t = first_task[i]; t < first_task[i + 1]; ++t) {
      const Found& f = found[t];
      const uint64_t at = list->values.size();
      for (size_t k = 0; k < f.runs.size(); ++k) {
        list->runs.push_back(f.runs[k]);
        list->values_at.push_back(at + f.at[k]);
        list->changed_bytes += f.runs[k].second - f.runs[k].first;
      }
      list->values.insert(list->values.end(), f.values.begin(), f.values.end());
      compared += tasks[t].end - tasks[t].begin;
    }
    list->values_at.push_back(list->values.size());
    (*lists)[i] = std::move(list);
    (*compared_of)[i] = compared;
  }
  return true;
}

// DiffRegions, its bytes compared added to `diffed` (refit_diff_bytes_total).
bool DiffCounted(const std::vector<DiffInput>& in, const CounterHandle& diffed,
                 std::vector<std::shared_ptr<ChangeList>>* lists,
                 std::vector<uint64_t>* compared_of) {
  uint64_t bytes = 0;
  const bool sparse = DiffRegions(in, lists, compared_of, &bytes);
  diffed.Add(static_cast<double>(bytes));
  return sparse;
}

}  // namespace

void Store::DiffPieces(std::vector<Piece*> pieces, const Version& base) {
  std::vector<DiffInput> in;
  std::vector<Piece*> diffed;
  for (Piece* piece_ptr : pieces) {
    Piece& piece = *piece_ptr;
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
    in.push_back({piece.slot->data(), piece.slot->size(), old->slot->data(), ranges});
    diffed.push_back(&piece);
  }
  std::vector<std::shared_ptr<ChangeList>> lists;
  std::vector<uint64_t> compared;
  if (!DiffCounted(in, counters_.diff_bytes, &lists, &compared)) return;
  for (size_t i = 0; i < diffed.size(); ++i) {
    diffed[i]->changes = std::move(lists[i]);
    diffed[i]->changes_base = base.number;
    diffed[i]->compared_bytes = compared[i];
  }
}

bool Store::TakeGatheredChanges(Piece* piece, const std::shared_ptr<const ChangeList>& changes,
                                const Version& base) {
  const Piece* old = nullptr;
  for (const Piece& b : base.pieces) {
    if (b.node == piece->node && b.buffer_id == piece->buffer_id) old = &b;
  }
  // What DiffPieces requires of a piece it diffs.
  if (!old || !old->slot || old->released || !piece->slot ||
      piece->slot->kind() != MemoryKind::kHost || old->slot->kind() != MemoryKind::kHost ||
      old->slot->size() != piece->slot->size()) {
    return false;
  }
  const ByteRanges whole{{0, piece->slot->size()}};
  const ByteRanges& ranges = piece->valid ? *piece->valid : whole;
  if (old->valid && *old->valid != ranges) return false;
  if (changes->values_at.size() != changes->runs.size() + 1) return false;
  uint64_t valid = 0;
  for (const auto& [b, e] : ranges) valid += e - b;
  size_t r = 0;
  for (const auto& [b, e] : changes->runs) {
    while (r < ranges.size() && ranges[r].second < e) ++r;
    if (r == ranges.size() || b < ranges[r].first) return false;  // outside what is held
  }
  piece->changes = changes;
  piece->changes_base = base.number;
  piece->compared_bytes = valid;
  return true;
}

void Store::DiffDerived(const Version& version, const Version& base,
                        const std::shared_ptr<const QuantBatch>& batch) {
  // The same batch quantizes both, so the slots have one layout: fp8 bytes and scales of the
  // same boxes at the same offsets. A registration or release since `base` was quantized made
  // a new batch: `base` is quantized again with it (from its held pieces; where they are not
  // held, no list: the full copy).
  const std::shared_ptr<Region> now = version.quant->Slot(batch.get());
  std::shared_ptr<Region> old = base.quant->Slot(batch.get());
  bool held = true;  // every piece of `base` is still here to quantize from
  for (const Piece& piece : base.pieces) held = held && piece.slot && !piece.released;
  if (!old && held && now && now->kind() == MemoryKind::kHost) {
    auto quantized = RunQuantBatch(base, batch, false);
    if (quantized.ok()) old = *quantized;
  }
  if (!now || !old || now->kind() != MemoryKind::kHost || old->kind() != MemoryKind::kHost ||
      now->size() != old->size() || batch->bytes() == 0) {
    return;
  }
  std::vector<DiffInput> in = {
      {now->data(), now->size(), old->data(), {{0, std::min(batch->bytes(), now->size())}}}};
  std::vector<std::shared_ptr<ChangeList>> lists;
  std::vector<uint64_t> compared;
  if (!DiffCounted(in, counters_.diff_bytes, &lists, &compared)) return;
  version.quant->SetChanges(batch.get(),
                            DerivedChanges{std::move(lists[0]), base.number, compared[0]});
}

std::shared_ptr<const Store::Version> Store::DiffBaseFor(const Model& model) const {
  if (model.destinations.empty() || model.latest == 0) return nullptr;
  auto it = model.complete.find(model.latest);
  return it == model.complete.end() ? nullptr : it->second;
}

}  // namespace refit
