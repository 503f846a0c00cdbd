// The prepared sparse Apply: as a version completes, the writes of its sparse Apply into each set
// of DESTINATION buffers applied together before are collected on the store's sparse-prepare
// thread (sparse_runs.h: the walk of the change lists, the conversion into the destinations'
// dtypes, the base's bytes at the checked writes), so that when the engine pauses for Apply the
// store only writes: per run, the check against the base where it is due, the undo record, the
// write and the check of what landed (host destinations, on several threads), or the run lists
// handed to a RunWriter (GPU destinations). docs/architecture.md, "Sparse Apply".

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda.h"
#include "cuda/run_writer.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/sparse_runs.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

using sparse::CopyBytes;
using sparse::kAhead;
using sparse::RunList;
using sparse::SameBytes;
using sparse::Segment;

// How long an Apply waits for its sparse Apply's writes being collected on the store's
// sparse-prepare thread, once that collection started (it takes about what collecting them in
// the call would; past this, the Apply goes on without them).
constexpr auto kPrepareWait = std::chrono::seconds(30);
// Sets of DESTINATION buffers remembered per model for prepared sparse Applies.
constexpr size_t kMaxApplyGroups = 16;
// A GPU destination's runs and new bytes (and the scratch of the same size) are uploaded as the
// version completes only while they take at most this share of its bytes of device memory (held
// until the Apply); larger ones are uploaded by the Apply.
constexpr uint64_t kUploadAheadShare = 16;

// One thread's share of a prepared host sparse Apply, one pass per run while its lines are in
// cache: where a check is due, the destination still holds the base (else stop: the full copy
// runs); the destination's bytes saved in the undo record; the new bytes written and compared.
// The destination lines of the run kAhead on are asked for first (scattered runs are bound by
// memory latency).
class alignas(64) PreparedWriter {  // one per thread, each on lines of its own
 public:
  PreparedWriter(const std::vector<RunList>& lists, const std::vector<uint8_t*>& dst,
                 ApplyJournal::Part& undo, std::atomic<bool>& stopped)
      : lists_(lists), dst_(dst), undo_(undo), stopped_(stopped) {}

  void Write(const std::vector<Segment>& segments) {
    for (const Segment& segment : segments) {
      if (!WriteSegment(segment)) return;
    }
  }

  uint64_t kill_at = 0;     // test build: a commit point after this many runs
  bool flip = false;        // test build: the first write's byte changes under it
  bool unverified = false;  // test build: what landed is not compared
  bool not_base = false;    // the destination did not hold the base where a check was due
  bool journal_full = false;
  uint32_t not_base_op = 0;
  std::vector<size_t> bad;  // ops whose bytes did not land

 private:
  bool WriteSegment(const Segment& s) {
    const RunList& list = lists_[s.list];
    uint8_t* const base = dst_[list.dest];
    const cuda::ByteRun* const runs = list.runs.data();
    const uint8_t* const values = list.values.data();
    size_t check = s.check, op = s.op;
    uint64_t expected = s.expected;
    for (uint64_t r = s.begin; r < s.end; ++r) {
      if (r + kAhead < s.end) __builtin_prefetch(base + runs[r + kAhead].dst_offset, 1);
      if ((done_ & 255) == 0 && stopped_.load(std::memory_order_relaxed)) return false;
      const cuda::ByteRun& run = runs[r];
      uint8_t* const to = base + run.dst_offset;
      const uint8_t* const value = values + run.value_offset;
      while (op + 1 < list.ops.size() && list.ops[op + 1].first <= r) ++op;
      // The checks over this run's values: the destination must hold the base's bytes there.
      const uint64_t v0 = run.value_offset, v1 = v0 + run.bytes;
      while (check < list.checks.size() && list.checks[check].first < v1) {
        const uint64_t c0 = list.checks[check].first, c1 = c0 + list.checks[check].second;
        const uint64_t x0 = std::max(c0, v0), x1 = std::min(c1, v1);
        if (x0 < x1 &&
            !SameBytes(to + (x0 - v0), list.expected.data() + expected + (x0 - c0), x1 - x0)) {
          return Stop(list.ops[op].second);
        }
        if (c1 > v1) break;  // goes on into the next run
        expected += c1 - c0;
        ++check;
      }
      if (!undo_.Save(list.dest, run.dst_offset, to, run.bytes)) return Full();
      CopyBytes(to, value, run.bytes);
      if (flip && done_ == 0) *to ^= 0x5a;
      if (!unverified && !SameBytes(to, value, run.bytes)) {
        if (bad.empty() || bad.back() != list.ops[op].second) bad.push_back(list.ops[op].second);
      }
      if (++done_ == kill_at) TestHookKillAt("apply");
    }
    return true;
  }
  bool Stop(uint32_t op) {
    not_base = true;
    not_base_op = op;
    stopped_.store(true);
    return false;
  }
  bool Full() {
    journal_full = true;
    stopped_.store(true);
    return false;
  }

  const std::vector<RunList>& lists_;
  const std::vector<uint8_t*>& dst_;
  ApplyJournal::Part& undo_;
  std::atomic<bool>& stopped_;
  uint64_t done_ = 0;
};

}  // namespace

std::string Store::GroupKey(const std::vector<std::shared_ptr<Buffer>>& dests) {
  std::vector<std::string> ids;
  for (const auto& d : dests) ids.push_back(d->id);
  return absl::StrJoin(ids, ",");
}

void Store::RememberApplyGroup(Model& model, const std::vector<std::shared_ptr<Buffer>>& dests) {
  if (!options_.prepare_sparse || dests.empty()) return;
  const std::string key = GroupKey(dests);
  auto [it, added] = model.apply_groups.try_emplace(key);
  if (added) {
    model.apply_group_order.push_back(key);
    while (model.apply_group_order.size() > kMaxApplyGroups) {
      model.apply_groups.erase(model.apply_group_order.front());
      model.prepared.erase(model.apply_group_order.front());
      model.apply_group_order.pop_front();
    }
  }
  it->second.assign(dests.begin(), dests.end());
  // What was prepared for the version just applied (or an older one) stays until the next
  // version's collection takes its lists to fill again (QueuePrepares).
  if (model.latest > dests[0]->applied) QueuePrepares(model);  // the engine is behind
}

void Store::QueuePrepares(Model& model) {
  if (!options_.prepare_sparse || model.apply_groups.empty() || model.latest == 0) return;
  // --delta-base=destination releases the held copy a sparse Apply reads N-1 from: nothing to
  // prepare (and a job would keep the version's slot until it ran).
  if (DeltaBaseOf(model.name) == DeltaBase::kDestination) return;
  auto newest = model.complete.find(model.latest);
  if (newest == model.complete.end()) return;
  for (auto group = model.apply_groups.begin(); group != model.apply_groups.end();) {
    std::vector<std::shared_ptr<Buffer>> dests;
    for (const std::weak_ptr<Buffer>& weak : group->second) {
      std::shared_ptr<Buffer> d = weak.lock();
      auto registered = d ? buffers_.find(d->id) : buffers_.end();
      if (registered == buffers_.end() || registered->second != d) break;  // released
      dests.push_back(std::move(d));
    }
    if (dests.size() != group->second.size()) {
      model.prepared.erase(group->first);
      model.apply_group_order.erase(
          std::find(model.apply_group_order.begin(), model.apply_group_order.end(), group->first));
      group = model.apply_groups.erase(group);
      continue;
    }
    const std::string& key = group->first;
    ++group;
    const uint64_t base = dests[0]->applied;
    bool same = true;
    for (const auto& d : dests) same = same && d->applied == base && d->refused.empty();
    auto held = model.complete.find(base);
    if (!same || base >= model.latest || held == model.complete.end()) continue;
    auto existing = model.prepared.find(key);
    if (existing != model.prepared.end() && existing->second->source.lock() == newest->second &&
        existing->second->held.lock() == held->second) {
      continue;
    }
    auto cached = PlanFor(model, *newest->second, dests);
    if (!cached.ok()) continue;
    auto out = std::make_shared<PreparedSparse>();
    out->gauge = counters_.sparse_prepared_bytes;
    out->version = model.latest;
    out->base = base;
    out->source = newest->second;
    out->held = held->second;
    out->plan = *cached;
    for (const auto& d : dests) out->dests.push_back(d.get());
    PrepareJob job{model.name, key, out, newest->second, held->second, dests, {}};
    if (existing != model.prepared.end() && existing->second->ready &&
        existing->second.use_count() == 1) {
      // No Apply holds it: each copy is made under mu_, and the last Apply's reads of its lists
      // come before its release of the copy (the count's decrement), which this fence orders
      // before the refill.
      std::atomic_thread_fence(std::memory_order_acquire);
      job.recycle = std::move(existing->second->lists);
      existing->second->lists.clear();
      existing->second->Account();  // counted again once they are filled
    }
    model.prepared[key] = out;
    prepare_jobs_.push_back(std::move(job));
    prepare_loop_.Notify();
  }
}

void Store::RunPrepares() {
  while (true) {
    PrepareJob job;
    {
      common::MutexLock lock(mu_);
      if (prepare_jobs_.empty()) return;
      job = std::move(prepare_jobs_.front());
      prepare_jobs_.pop_front();
      // Skipped: at shutdown; taken back by an Apply that came before it started (it collects
      // in the call); or no longer its set's entry (a newer version, a new run, the set gone)
      // with no Apply waiting for it.
      bool current = false;
      if (const Model* model = FindModel(job.model)) {
        auto entry = model->prepared.find(job.key);
        current = entry != model->prepared.end() && entry->second == job.out;
      }
      if (shutdown_ || job.out->ready || (!current && job.out.use_count() == 1)) {
        job.out->why = "skipped";
        job.out->ready = true;
        changed_.NotifyAll();
        continue;
      }
      job.out->started = true;
    }
    PreparedSparse& out = *job.out;
    const auto started = Clock::now();
    const CachedPlan& cached = *out.plan;
    auto why_not = [&]() -> std::string {
      std::vector<std::shared_ptr<Region>> derived;
      if (!cached.jobs.empty()) {
        auto slots = QuantizedSlots(*job.version, cached);
        if (!slots.ok()) return slots.status().ToString();
        derived = std::move(slots).value();
      }
      std::optional<SparseInputs> inputs =
          SparseInputsFor(*job.version, *job.held, cached, job.dests.size(), derived);
      if (!inputs) return "not diffed against the version its destinations hold";
      if (inputs->changed * kDenseShareInverse > inputs->compared) return "dense";
      bool host = options_.sparse_run_writers == nullptr;
      for (const auto& d : job.dests) host = host && d->region->kind() == MemoryKind::kHost;
      const uint64_t per_run = host ? options_.sparse_prepared_bytes_per_run
                                    : options_.gpu_sparse_prepared_bytes_per_run;
      static const bool always = TestSwitch("REFIT_TEST_SPARSE_ALWAYS") != nullptr;
      if (!always && per_run > 0 && inputs->runs * per_run >= cached.plan.dst_bytes) {
        return absl::StrCat(inputs->runs, " changed runs: the full copy is cheaper");
      }
      const unsigned threads = sparse::ThreadsFor(inputs->runs, SparseThreadsWanted(options_));
      // A RunWriter takes one list per destination; the host writer the chunks as collected.
      out.lists = sparse::CollectRuns(cached.plan, inputs->sources(), job.dests.size(), threads,
                                      /*merged=*/!host, &job.recycle);
      out.runs = inputs->runs;
      if (host) {
        out.cuts = sparse::CutRuns(out.lists, threads);
      } else {
        UploadAhead(job.dests, &out);
      }
      return "";
    };
    out.why = why_not();
    out.usable = out.why.empty();
    out.Account();
    out.collect_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    Logger("store")->debug("model={} version={}: sparse Apply into {} {}", job.model, out.version,
                           GroupKey(job.dests),
                           out.usable ? absl::StrCat("prepared: ", out.runs, " runs in ",
                                                     absl::SixDigits(out.collect_ms), " ms")
                                      : absl::StrCat("not prepared: ", out.why));
    common::MutexLock lock(mu_);
    out.ready = true;
    changed_.NotifyAll();
  }
}

void Store::UploadAhead(const std::vector<std::shared_ptr<Buffer>>& dests, PreparedSparse* out) {
  out->regions.resize(dests.size());
  out->writers.resize(dests.size());
  for (size_t j = 0; j < dests.size() && j < out->lists.size(); ++j) {
    const sparse::RunList& list = out->lists[j];
    const Region& region = *dests[j]->region;
    const uint64_t bytes = list.runs.size() * sizeof(cuda::ByteRun) + 2 * list.values.size();
    if (list.runs.empty() || bytes > region.size() / kUploadAheadShare) continue;
    auto writer = options_.sparse_run_writers ? options_.sparse_run_writers->Open(region)
                                              : cuda::OpenRunWriter(region);
    if (!writer.ok()) continue;  // the Apply opens one and says why
    if (!(*writer)->Upload(list.runs, list.values).ok()) continue;  // the Apply uploads
    out->regions[j] = dests[j]->region;
    out->writers[j] = std::move(writer).value();
  }
}

std::shared_ptr<const Store::PreparedSparse> Store::AwaitPrepared(
    Model& model, common::UniqueLock& lock, const std::shared_ptr<const Version>& source,
    const std::shared_ptr<const Version>& held, const std::vector<std::shared_ptr<Buffer>>& dests) {
  auto entry = model.prepared.find(GroupKey(dests));
  if (entry == model.prepared.end() || entry->second->source.lock() != source ||
      entry->second->held.lock() != held) {
    return nullptr;
  }
  // A collection in progress (or next in line) is waited for rather than the change lists walked
  // again in the call; one queued behind other sets' or models' is taken back.
  std::shared_ptr<PreparedSparse> waited = entry->second;
  const bool next = !prepare_jobs_.empty() && prepare_jobs_.front().out == waited;
  if (!waited->started && !waited->ready && !next) {
    waited->why = "taken back by an Apply before it started";
    waited->ready = true;
  }
  changed_.WaitUntil(lock, Clock::now() + kPrepareWait, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return waited->ready || shutdown_;
  });
  if (!waited->ready || shutdown_) return nullptr;
  return waited;
}

absl::StatusOr<size_t> Store::WaitForSparsePrepared(const std::string& model_name, uint64_t version,
                                                    Clock::time_point deadline) {
  common::UniqueLock lock(mu_);
  size_t ready = 0;
  auto all_ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ready = 0;
    const Model* model = FindModel(model_name);
    if (!model || shutdown_) return true;
    for (const auto& [key, prepared] : model->prepared) {
      if (prepared->version != version) continue;
      if (!prepared->ready) return false;
      ++ready;
    }
    return true;
  };
  if (!changed_.WaitUntil(lock, deadline, all_ready)) {
    return absl::DeadlineExceededError(
        absl::StrCat("model ", model_name, " version ", version, ": sparse Apply still prepared"));
  }
  return ready;
}

std::optional<absl::StatusOr<ApplyResult>> Store::ApplyPrepared(
    const Version& version, const Version& held, const CachedPlan& cached,
    const std::vector<std::shared_ptr<Buffer>>& dests, const PreparedSparse& prepared,
    bool* full_copy) {
  const uint64_t base = held.number;
  if (!prepared.usable || prepared.source.lock().get() != &version ||
      prepared.held.lock().get() != &held || prepared.plan.get() != &cached ||
      prepared.dests.size() != dests.size()) {
    return std::nullopt;
  }
  bool host = options_.sparse_run_writers == nullptr;
  for (size_t j = 0; j < dests.size(); ++j) {
    if (prepared.dests[j] != dests[j].get() || dests[j]->applied != base) return std::nullopt;
    host = host && dests[j]->region->kind() == MemoryKind::kHost;
  }
  const plan::Plan& plan = cached.plan;
  if (!host) {
    if (prepared.lists.size() != dests.size()) return std::nullopt;  // (collected for host ones)
    auto applied = ApplySparseRuns(
        version, base, plan, prepared.lists,
        absl::StrCat("prepared as it completed (", absl::SixDigits(prepared.collect_ms), " ms)"),
        dests, &prepared.writers);
    if (applied && applied->ok()) (*applied)->prepared = true;
    if (!applied) *full_copy = true;  // not held, or no writer: the same in the call
    return applied;
  }
  const auto t_start = Clock::now();
  const sparse::HostCuts& cuts = prepared.cuts;
  const unsigned threads = static_cast<unsigned>(cuts.workers.size());
  auto undo = journal_->BeginSparse(UndoTargets(cached, dests, version.number), cuts.capacities);
  if (undo.status().code() == absl::StatusCode::kInvalidArgument) return std::nullopt;
  if (!undo.ok()) return absl::StatusOr<ApplyResult>(undo.status());
  std::vector<uint8_t*> dst;
  for (const auto& d : dests) dst.push_back(d->region->data());
  std::atomic<bool> stopped{false};
  std::vector<PreparedWriter> writers;
  writers.reserve(threads);
  static const bool unverified = TestSwitch("REFIT_TEST_APPLY_UNVERIFIED") != nullptr;
  for (unsigned w = 0; w < threads; ++w) {
    writers.emplace_back(prepared.lists, dst, (*undo)->part(w), stopped);
    writers.back().unverified = unverified;
  }
  // Test build: killed half-way through the busiest thread's writes (the others mid-way too),
  // and a byte flipped under the first write of the first N sparse Applies (as the sparse
  // Apply collected inside the call does).
  const unsigned busiest = static_cast<unsigned>(
      std::max_element(cuts.runs.begin(), cuts.runs.end()) - cuts.runs.begin());
  PreparedWriter& writer = writers[busiest];
  writer.kill_at = std::max<uint64_t>(1, cuts.runs[busiest] / 2);
  writer.flip = TakeSparseFlip();
  sparse::ParallelFor(threads, [&](unsigned w) { writers[w].Write(cuts.workers[w]); });
  SparseEnd end;
  for (const PreparedWriter& w : writers) {
    if ((w.not_base || w.journal_full) && !end.not_base_op) end.not_base_op = w.not_base_op;
    end.bad.insert(end.bad.end(), w.bad.begin(), w.bad.end());
  }
  const uint64_t undo_bytes = (*undo)->undo_bytes();
  const bool not_base = end.not_base_op.has_value();
  std::optional<absl::Status> ended = EndSparse(version, base, plan, dests, **undo, std::move(end));
  if (!ended) {
    *full_copy = not_base;
    return std::nullopt;
  }
  if (!ended->ok()) return absl::StatusOr<ApplyResult>(*ended);
  uint64_t written = 0, runs = 0;
  for (const RunList& list : prepared.lists) {
    written += list.values.size();
    runs += list.runs.size();
  }
  Logger("store")->debug(
      "sparse Apply of version {}: {} runs, {} bytes, {} thread(s): prepared as it completed "
      "({:.1f} ms), checked, saved, written and verified {:.1f} ms",
      version.number, runs, written, threads, prepared.collect_ms,
      std::chrono::duration<double, std::milli>(Clock::now() - t_start).count());
  return absl::StatusOr<ApplyResult>(ApplyResult{version.number, written, undo_bytes, true, true});
}

}  // namespace refit
