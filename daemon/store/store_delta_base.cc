// Store: --delta-base=destination. On an engine's node whose DESTINATION buffers are host memory,
// the version they hold stands in for the held copy a delta is applied to:
//
// 1. After a verified Apply of the newest version N, once every DESTINATION buffer of the model
//    holds N (Buffer::applied), the held copy of N's pulled pieces is hashed (XXH3 per range
//    of the piece's valid bytes cut at the checksum grid) and released (ReleaseApplied). The
//    node then holds no copy of the model at all; the version record stays (Watch, Status).
// 2. When N+1 is announced with deltas from N, OfferDelta marks the fetch destination_base
//    instead of handing it a held slot (CanUseDestinationBase).
// 3. The pull worker calls BaseFromDestinations: it rebuilds N's bytes of the piece from the
//    destinations (the Apply plan run backwards) into a fresh staging slot, checks them against
//    the digests, and the deltas are applied in that slot, which becomes N+1's held slot. The
//    destinations themselves are only read: the engine sees N until the Apply of N+1.
//
// Anything else (a destination written since, a failed Apply, buffers registered again, GPU or
// converting destinations) means no destination base: a full pull, counted in
// refit_delta_base_fallbacks_total and logged with the reason (the tensors, on a mismatch).

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/memory/checksum.h"
#include "daemon/memory/stream_copy.h"
#include "daemon/plan/plan.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

// `valid` (sorted, merged) cut at the checksum grid and where the ops reading piece `index`
// begin and end (so that a mismatch names the tensors it is in): what is hashed and compared.
ByteRanges Segments(const ByteRanges& valid, const plan::Plan& plan, size_t index) {
  std::vector<uint64_t> cuts;
  for (const plan::CopyOp& op : plan.ops) {
    if (op.src_location != index) continue;
    ByteRanges runs;
    AppendSourceRuns(op, &runs);
    cuts.push_back(runs.front().first);
    cuts.push_back(runs.back().second);
  }
  std::sort(cuts.begin(), cuts.end());
  ByteRanges out;
  auto next_cut = cuts.begin();
  for (auto [begin, end] : valid) {
    while (begin < end) {
      uint64_t cut = std::min(end, (begin / kChecksumChunkBytes + 1) * kChecksumChunkBytes);
      next_cut = std::upper_bound(next_cut, cuts.end(), begin);
      if (next_cut != cuts.end() && *next_cut < cut) cut = *next_cut;
      out.emplace_back(begin, cut);
      begin = cut;
    }
  }
  return out;
}

// Runs fn(0) .. fn(n - 1) over the cores; each thread orders its streaming stores when done.
void EachOnCores(size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
    StoreFence();
  };
  const unsigned threads = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads && t < n; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

// Copies `segments` of the piece from the destinations into `slot` and hashes each as it lands
// (one pass, over the cores) when every segment lies inside one contiguous op of `forward` from
// piece `index` (whole-tensor and row-sharded layouts); false (nothing done) otherwise.
bool CopyAndHashSegments(const plan::Plan& forward, size_t index, const ByteRanges& segments,
                         const std::vector<const uint8_t*>& dests, uint8_t* slot,
                         std::vector<uint64_t>* sums) {
  struct Run {
    uint64_t begin, end;  // in the piece
    const uint8_t* from;  // the piece's byte `begin` in its destination
  };
  std::vector<Run> runs;
  for (const plan::CopyOp& op : forward.ops) {
    if (op.src_location != index) continue;
    if (op.rows != 1 || op.src_stride != 1 || op.dst_stride != 1) return false;
    const uint64_t bytes = op.count * DTypeSize(op.src_dtype);
    runs.push_back({op.src_offset, op.src_offset + bytes, dests[op.dst_location] + op.dst_offset});
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.begin < b.begin; });
  std::vector<const uint8_t*> from(segments.size());
  for (size_t s = 0; s < segments.size(); ++s) {
    auto it = std::upper_bound(runs.begin(), runs.end(), segments[s].first,
                               [](uint64_t at, const Run& r) { return at < r.begin; });
    if (it == runs.begin()) return false;
    --it;
    if (segments[s].second > it->end) return false;
    from[s] = it->from + (segments[s].first - it->begin);
  }
  sums->assign(segments.size(), 0);
  EachOnCores(segments.size(), [&](size_t s) {
    const auto& [begin, end] = segments[s];
    (*sums)[s] = CopyAndHashRange(slot + begin, from[s], end - begin);
  });
  return true;
}

// XXH3-64 of each of `segments` of `data`, over the cores.
std::vector<uint64_t> HashSegments(const uint8_t* data, const ByteRanges& segments) {
  std::vector<uint64_t> sums(segments.size());
  EachOnCores(segments.size(),
              [&](size_t s) { sums[s] = HashRanges(data, {segments[s]}).front(); });
  return sums;
}

}  // namespace

DeltaBase Store::DeltaBaseOf(const std::string& model) const { return delta_base_.Of(model); }

void Store::ReleaseApplied(const std::string& model_name,
                           const std::shared_ptr<const Version>& version) {
  if (DeltaBaseOf(model_name) != DeltaBase::kDestination) return;
  const uint64_t number = version->number;
  std::shared_ptr<const CachedPlan> plan;
  std::vector<std::shared_ptr<Buffer>> dests;
  std::vector<size_t> release;
  {
    common::MutexLock lock(mu_);
    Model* model = FindModel(model_name);
    if (!model || model->latest != number) return;
    auto it = model->complete.find(number);
    if (it == model->complete.end() || it->second != version) return;
    auto keep_held = [&](const std::string& why) {
      if (model->delta_base_note != why) {
        Logger("store")->warn(
            "model={} --delta-base=destination: keeping the held copy as the "
            "delta base: {}",
            model_name, why);
      }
      model->delta_base_note = why;
    };
    for (const std::string& id : model->destinations) {
      const std::shared_ptr<Buffer>& buffer = buffers_.at(id);
      if (!buffer->refused.empty()) continue;  // in no plan
      if (buffer->region->kind() != MemoryKind::kHost) {
        return keep_held(absl::StrCat("DESTINATION buffer ", id, " is GPU memory"));
      }
      if (buffer->applied != number) return;  // not every destination holds it yet
      dests.push_back(buffer);
    }
    if (dests.empty()) return;
    auto cached = PlanFor(*model, *version, dests);
    if (!cached.ok()) return;
    plan = *cached;
    if (!plan->jobs.empty() || model->HasScales()) {
      return keep_held("fp8 destinations with scales are quantized, not copied");
    }
    for (const plan::CopyOp& op : plan->plan.ops) {
      if (op.src_dtype != op.dst_dtype) {
        return keep_held("a DESTINATION buffer converts dtypes (the copy can't be undone)");
      }
    }
    model->delta_base_note.clear();
    for (size_t i = 0; i < version->pieces.size(); ++i) {
      const Piece& piece = version->pieces[i];
      // Pulled pieces only: local snapshots serve other nodes, imported ones came whole.
      if (!piece.node.empty() && piece.slot && piece.valid &&
          piece.slot->kind() == MemoryKind::kHost) {
        release.push_back(i);
      }
    }
    if (release.empty()) return;
  }
  // Outside the lock: the digests of what is released (the slots stay alive: `version`).
  auto base = std::make_shared<DestinationBase>();
  base->version = number;
  base->plan = plan;
  base->dests = dests;
  uint64_t bytes = 0;
  for (size_t i : release) {
    const Piece& piece = version->pieces[i];
    DestinationBase::Digests& digests = base->pieces[i];
    digests.segments = Segments(*piece.valid, plan->plan, i);
    digests.xxh3 = HashSegments(piece.slot->data(), digests.segments);
    bytes += piece.slot->size();
  }
  auto kept = std::make_shared<Version>(*version);
  kept->bytes = 0;
  for (size_t i : release) {
    kept->pieces[i].slot.reset();
    kept->pieces[i].released = true;
  }
  for (const Piece& piece : kept->pieces) {
    if (piece.slot) kept->bytes += piece.slot->size();
  }
  base->source = kept;
  common::MutexLock lock(mu_);
  Model* model = FindModel(model_name);
  if (!model) return;
  auto it = model->complete.find(number);
  if (it == model->complete.end() || it->second != version) return;  // dropped or replaced
  it->second = std::move(kept);
  model->destination_base = std::move(base);
  Logger("store")->info(
      "model={} version={}: every DESTINATION buffer holds it; released the "
      "held copy ({} bytes): the next delta is applied to their bytes",
      model_name, number, bytes);
}

bool Store::CanUseDestinationBase(const Model& model, const Piece& piece,
                                  const PullJob::Fetch& fetch) const {
  auto fallback = [&](const std::string& why) {
    Logger("delta")->warn(
        "model={} buffer={}: the destinations can't be the delta base from "
        "version {} ({}); pulling in full",
        model.name, fetch.buffer_id, model.latest, why);
    counters_.delta_base_fallbacks.Add(1);
    return false;
  };
  const std::shared_ptr<const DestinationBase>& base = model.destination_base;
  if (!base || base->version != model.latest) {
    return fallback(
        "no DESTINATION buffer holds it since an Apply: not every one applied it, "
        "or one was released since");
  }
  size_t index = base->source->pieces.size();
  for (size_t i = 0; i < base->source->pieces.size(); ++i) {
    const Piece& p = base->source->pieces[i];
    if (p.node == piece.node && p.buffer_id == piece.buffer_id) index = i;
  }
  auto digests = base->pieces.find(index);
  if (digests == base->pieces.end()) return fallback("its piece was not released");
  std::vector<std::string> gone;
  for (const auto& d : base->dests) {
    if (d->applied != base->version || !buffers_.count(d->id)) gone.push_back(d->id);
  }
  if (!gone.empty()) {
    return fallback(absl::StrCat("DESTINATION buffer(s) ", absl::StrJoin(gone, ", "),
                                 " no longer hold it: released, re-registered, or a failed "
                                 "Apply since"));
  }
  // Every needed byte must be one the destinations hold (a new buffer may need more).
  const ByteRanges& held = digests->second.segments;
  for (const auto& [begin, end] : fetch.ranges) {
    auto it = std::upper_bound(held.begin(), held.end(), std::make_pair(begin, UINT64_MAX));
    uint64_t at = begin;
    if (it != held.begin()) --it;
    for (; it != held.end() && it->first <= at && at < end; ++it) at = std::max(at, it->second);
    if (at < end) return fallback("the destinations hold fewer of its bytes than this pull needs");
  }
  return true;
}

absl::StatusOr<std::shared_ptr<Region>> Store::BaseFromDestinations(const std::string& model_name,
                                                                    const PullJob::Fetch& fetch) {
  std::shared_ptr<const DestinationBase> base;
  std::vector<std::string> gone;  // buffers released since: their owners may write them
  {
    common::MutexLock lock(mu_);
    const Model* model = FindModel(model_name);
    if (model) base = model->destination_base;
    for (size_t i = 0; base && i < base->dests.size(); ++i) {
      auto it = buffers_.find(base->dests[i]->id);
      if (it == buffers_.end() || it->second != base->dests[i]) gone.push_back(base->dests[i]->id);
    }
  }
  if (!base || base->version != fetch.base_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_name, ": the destinations are not a base for version ",
                     fetch.base_version, " any more"));
  }
  if (!gone.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_name, ": DESTINATION buffer(s) ", absl::StrJoin(gone, ", "),
                     " were released since the Apply of version ", base->version));
  }
  size_t index = base->source->pieces.size();
  for (size_t i = 0; i < base->source->pieces.size(); ++i) {
    const Piece& p = base->source->pieces[i];
    if (p.node == fetch.node && p.buffer_id == fetch.buffer_id) index = i;
  }
  auto digests = base->pieces.find(index);
  if (digests == base->pieces.end() || base->source->pieces[index].slot ||
      !base->source->pieces[index].released) {
    return absl::FailedPreconditionError(
        absl::StrCat("piece ", fetch.buffer_id, " of ", model_name, " was not released"));
  }
  // The plan's ops from this piece, backwards: destination bytes -> the piece's offsets.
  plan::Plan back;
  std::vector<size_t> ops;  // index in base->plan of each op of `back`
  const plan::Plan& forward = base->plan->plan;
  for (size_t i = 0; i < forward.ops.size(); ++i) {
    const plan::CopyOp& op = forward.ops[i];
    if (op.src_location != index) continue;
    plan::CopyOp b = op;
    b.src_location = op.dst_location;
    b.src_offset = op.dst_offset;
    b.src_stride = op.dst_stride;
    b.src_row_stride = op.dst_row_stride;
    b.dst_location = 0;
    b.dst_offset = op.src_offset;
    b.dst_stride = op.src_stride;
    b.dst_row_stride = op.src_row_stride;
    back.ops.push_back(b);
    ops.push_back(i);
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Region> slot, AcquireSlot(fetch.bytes));
  std::vector<uint64_t> got;  // the digests of what was rebuilt
  if (slot->size() < fetch.bytes || slot->kind() != MemoryKind::kHost) {
    return absl::InternalError("a staging slot of the wrong size or kind");
  }
  {
    std::vector<Buffer*> order;
    for (const auto& d : base->dests) order.push_back(d.get());
    std::sort(order.begin(), order.end(),
              [](const Buffer* a, const Buffer* b) { return a->id < b->id; });
    std::vector<std::unique_lock<common::Mutex>> locks;
    for (Buffer* b : order) locks.emplace_back(b->io_mu);
    std::vector<const uint8_t*> src;
    for (const auto& d : base->dests) {
      if (d->applied != base->version || d->region->Broken()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "DESTINATION buffer ", d->id, " of ", model_name, " no longer holds version ",
            base->version, " (a failed Apply, or its memory went away)"));
      }
      src.push_back(d->region->data());
    }
    if (!CopyAndHashSegments(forward, index, digests->second.segments, src, slot->data(), &got)) {
      plan::ExecuteOnHost(back, src, {slot->data()});
      got = HashSegments(slot->data(), digests->second.segments);
    }
  }
  // The bytes rebuilt must be version base->version's exactly.
  const DestinationBase::Digests& want = digests->second;
  ByteRanges differ;
  for (size_t s = 0; s < got.size(); ++s) {
    if (got[s] != want.xxh3[s]) differ.push_back(want.segments[s]);
  }
  if (differ.empty()) return slot;
  std::vector<size_t> bad;
  for (size_t b = 0; b < back.ops.size(); ++b) {
    ByteRanges runs;
    AppendSourceRuns(forward.ops[ops[b]], &runs);
    const bool hit = std::any_of(runs.begin(), runs.end(), [&](const auto& run) {
      return std::any_of(differ.begin(), differ.end(), [&](const auto& d) {
        return run.first < d.second && d.first < run.second;
      });
    });
    if (hit) bad.push_back(ops[b]);
  }
  std::vector<std::string> parts;
  for (const auto& [id, names] : TensorsOfOps(forward, bad, base->dests)) {
    parts.push_back(absl::StrCat("buffer ", id, ": ", absl::StrJoin(names, ", ")));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("model ", model_name, ": DESTINATION bytes differ from version ", base->version,
                   " their last Apply installed (written by someone else since?): ",
                   absl::StrJoin(parts, "; ")));
}

}  // namespace refit
