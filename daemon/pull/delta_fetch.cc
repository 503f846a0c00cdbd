#include "daemon/pull/delta_fetch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/delta/delta.h"
#include "daemon/memory/stream_copy.h"
#include "daemon/pull/relay_read.h"
#include "daemon/store/store_metrics.h"

namespace refit::pull {
namespace {

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

// One delta of a chain being fetched: its bytes land at their own offsets in `slot`.
struct Step {
  size_t fetch = 0;  // index into the job's fetches
  RemoteDeltaRef ref;
  std::shared_ptr<Region> slot;
  delta::DeltaIndex index;
  std::vector<size_t> chunks;  // the chunks covering the fetch's ranges
  Ranges payload;              // their bytes in the delta, merged
  uint64_t wire = 0;           // header + payload bytes
};

absl::StatusOr<std::shared_ptr<Region>> Allocate(uint64_t size) {
  auto region = AllocateHost(std::max<uint64_t>(size, 1));
  if (!region.ok()) return region.status();
  return std::shared_ptr<Region>(std::move(region).value());
}

// A PullJob whose fetches read deltas instead of pieces, one fetch per step.
PullJob DeltaJob(const PullJob& job, const std::vector<Step>& steps,
                 const std::vector<Ranges>& ranges) {
  PullJob out;
  out.model = job.model;
  out.version = job.version;
  for (size_t s = 0; s < steps.size(); ++s) {
    const PullJob::Fetch& f = job.fetches[steps[s].fetch];
    out.fetches.push_back({f.node,
                           f.buffer_id,
                           steps[s].ref.remote_key,
                           steps[s].ref.bytes,
                           ranges[s],
                           nullptr,
                           0,
                           {}});
  }
  return out;
}

// Reads the rest of every step's header (the first kFixedHeaderBytes are in its slot), parses
// it and picks the chunks the fetch needs.
absl::Status PlanSteps(const PullJob& job, const PullJob& delta_job, DataPlane* data_plane,
                       std::vector<Step>& steps) {
  std::vector<std::future<absl::Status>> rest(steps.size());
  std::vector<uint64_t> header(steps.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    auto size = delta::HeaderSize(steps[s].slot->data(), delta::kFixedHeaderBytes);
    if (!size.ok()) return size.status();
    if (*size > steps[s].ref.bytes) return absl::DataLossError("delta header past its end");
    header[s] = *size;
    rest[s] = data_plane->Refetch(delta_job, s, {{delta::kFixedHeaderBytes, *size}}, steps[s].slot);
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    RETURN_IF_ERROR(rest[s].get());
    Step& step = steps[s];
    ASSIGN_OR_RETURN(step.index, delta::ParseIndex(step.slot->data(), header[s]));
    const PullJob::Fetch& fetch = job.fetches[step.fetch];
    if (step.index.total_size != step.ref.bytes || step.index.buffer_bytes() != fetch.bytes) {
      return absl::DataLossError(absl::StrCat("delta ", step.ref.base_version, "->",
                                              step.ref.version, " of ", fetch.buffer_id,
                                              " does not fit the piece"));
    }
    const uint64_t es = step.index.element_size;
    for (const auto& [begin, end] : fetch.ranges) {
      const uint64_t first = begin / es, last = (end + es - 1) / es;  // elements touched
      for (size_t c : delta::ChunksOverlapping(step.index, first, last - first)) {
        if (step.chunks.empty() || step.chunks.back() < c) step.chunks.push_back(c);
      }
    }
    std::sort(step.chunks.begin(), step.chunks.end());
    step.chunks.erase(std::unique(step.chunks.begin(), step.chunks.end()), step.chunks.end());
    step.wire = header[s];
    for (size_t c : step.chunks) {
      const delta::ChunkInfo& info = step.index.chunks[c];
      const uint64_t b = info.encoded_offset, e = b + info.encoded_size;
      if (!step.payload.empty() && step.payload.back().second == b) {
        step.payload.back().second = e;
      } else {
        step.payload.emplace_back(b, e);
      }
      step.wire += info.encoded_size;
    }
  }
  return absl::OkStatus();
}

// True when every chunk a step uses lies wholly inside the fetch's ranges.
bool WholeChunks(const PullJob::Fetch& fetch, const std::vector<const Step*>& chain) {
  for (const Step* step : chain) {
    const uint64_t es = step->index.element_size;
    for (size_t c : step->chunks) {
      const delta::ChunkInfo& info = step->index.chunks[c];
      const uint64_t begin = info.first_element * es, end = begin + info.num_elements * es;
      auto it = std::upper_bound(fetch.ranges.begin(), fetch.ranges.end(),
                                 std::make_pair(begin, UINT64_MAX));
      if (it == fetch.ranges.begin() || (--it)->second < end) return false;
    }
  }
  return true;
}

// One chunk's part of a change list: `runs` (the elements its steps wrote; each step's in
// order, so sorted here when there were several) merged where they touch, and the new bytes of
// their 8-byte words, read from `data` (the piece's bytes at their offsets; the chunk was just
// written, so they are in cache), at most `size` bytes of the piece.
void GatherChunk(ChangeRuns* runs, bool several_steps, const uint8_t* data, uint64_t size,
                 ChangeList* part) {
  if (several_steps) std::sort(runs->begin(), runs->end());
  for (const auto& [b, e] : *runs) {
    if (!part->runs.empty() && part->runs.back().second >= b) {
      part->runs.back().second = std::max(part->runs.back().second, e);
    } else {
      part->runs.emplace_back(b, e);
    }
  }
  runs->clear();
  part->values_at.reserve(part->runs.size() + 1);
  for (const auto& [b, e] : part->runs) {
    const uint64_t lo = b & ~uint64_t{7}, hi = std::min(size, (e + 7) & ~uint64_t{7});
    part->values_at.push_back(part->values.size());
    part->values.insert(part->values.end(), data + lo, data + hi);
    part->changed_bytes += e - b;
  }
  part->values_at.push_back(part->values.size());
}

// The chunks' parts, in chunk order, as one change list (runs that touch across a chunk's edge
// are left apart: each carries its own words).
std::shared_ptr<const ChangeList> JoinChunks(std::vector<ChangeList> parts) {
  auto list = std::make_shared<ChangeList>();
  uint64_t runs = 0, values = 0;
  for (const ChangeList& part : parts) {
    runs += part.runs.size();
    values += part.values.size();
  }
  list->runs.reserve(runs);
  list->values_at.reserve(runs + 1);
  list->values.reserve(values);
  for (const ChangeList& part : parts) {
    if (part.runs.empty()) continue;
    const uint64_t at = list->values.size();
    list->runs.insert(list->runs.end(), part.runs.begin(), part.runs.end());
    for (size_t k = 0; k < part.runs.size(); ++k) list->values_at.push_back(at + part.values_at[k]);
    list->values.insert(list->values.end(), part.values.begin(), part.values.end());
    list->changed_bytes += part.changed_bytes;
  }
  list->values_at.push_back(list->values.size());
  return list;
}

// Copies the base's needed ranges into a fresh slot and applies the fetch's steps in order; a
// base rebuilt from the destinations (`in_place`) is a staging slot already, patched where it is.
// With whole chunks each chunk's result is checked against the source's checksum of it. The
// work is split by chunk (every delta of a piece has the same chunk geometry) over the cores:
// each chunk is copied and patched while it is in cache.
// `changes`: with whole chunks of 8-byte multiples, what the chain changed — the elements its
// steps wrote, as runs, and the new bytes of their words, gathered while each chunk is in
// cache — for the store's sparse Apply (ChangeList); left null otherwise.
absl::StatusOr<std::shared_ptr<Region>> Build(const PullJob::Fetch& fetch,
                                              const std::shared_ptr<Region>& base,
                                              const std::vector<const Step*>& chain,
                                              bool whole_chunks, bool in_place, PullLanding* store,
                                              std::shared_ptr<const ChangeList>* changes) {
  std::shared_ptr<Region> slot = base;
  if (!in_place) {
    ASSIGN_OR_RETURN(slot, store->AcquireSlot(fetch.bytes));
  }
  const delta::DeltaIndex& first = chain.front()->index;
  for (const Step* step : chain) {
    if (step->index.chunk_elements != first.chunk_elements ||
        step->index.element_size != first.element_size) {
      return absl::FailedPreconditionError("the deltas of a chain differ in chunk geometry");
    }
  }
  const uint64_t chunk_bytes = first.chunk_elements * first.element_size;
  const uint64_t num_chunks = (fetch.bytes + chunk_bytes - 1) / std::max<uint64_t>(1, chunk_bytes);
  // Per chunk: the steps that change it.
  std::vector<std::vector<std::pair<const Step*, size_t>>> work(num_chunks);
  for (const Step* step : chain) {
    for (size_t c : step->chunks) work[c].emplace_back(step, c);
  }
  // Per chunk: the bytes its steps changed, then its part of the change list.
  const bool gather = whole_chunks && chunk_bytes % 8 == 0;
  std::vector<ChangeRuns> changed_in(gather ? num_chunks : 0);
  std::vector<ChangeList> parts(gather ? num_chunks : 0);
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  absl::Status failed;
  auto fail = [&](absl::Status status) {
    std::lock_guard<std::mutex> lock(mu);
    if (failed.ok()) failed = std::move(status);
    next = num_chunks;
  };
  // A changed chunk, with whole chunks, is built in a buffer in cache (512 KiB for bf16 at the
  // default 2^18 elements) and streamed into the slot: two passes over memory instead of three
  // (a memcpy into the slot reads each line of it first). ApplyChunkTo checks the chunk's
  // target checksum on that buffer; the slot gets exactly its bytes. Chunks larger than
  // kBounceMax (a sender's choice) are patched in place in the slot, as before.
  constexpr uint64_t kBounceMax = 4ull << 20;
  const bool bounce_chunks = whole_chunks && chunk_bytes <= kBounceMax;
  auto run = [&] {
    std::vector<uint8_t> bounce;
    for (uint64_t c = next++; c < num_chunks; c = next++) {
      const uint64_t lo = c * chunk_bytes, hi = std::min(fetch.bytes, lo + chunk_bytes);
      // Where the chunk's steps report what they changed: only when a change list is gathered.
      ChangeRuns* record = gather ? &changed_in[c] : nullptr;
      if (bounce_chunks && !work[c].empty()) {
        bounce.resize(hi - lo);
        std::memcpy(bounce.data(), base->data() + lo, hi - lo);
        for (const auto& [step, chunk] : work[c]) {
          const delta::ChunkInfo& info = step->index.chunks[chunk];
          if (info.first_element * first.element_size != lo) {
            return fail(absl::FailedPreconditionError("a delta chunk is not where expected"));
          }
          absl::Status status =
              delta::ApplyChunkTo(step->index, chunk, step->slot->data() + info.encoded_offset,
                                  info.encoded_size, bounce.data(), bounce.size(), record);
          if (!status.ok()) return fail(std::move(status));
        }
        if (gather) {
          GatherChunk(&changed_in[c], chain.size() > 1, bounce.data() - lo, fetch.bytes, &parts[c]);
        }
        StreamCopy(slot->data() + lo, bounce.data(), hi - lo);
        continue;
      }
      // The needed ranges overlapping [lo, hi), copied from the base.
      auto it = std::partition_point(fetch.ranges.begin(), fetch.ranges.end(),
                                     [lo](const auto& r) { return r.second <= lo; });
      for (; !in_place && it != fetch.ranges.end() && it->first < hi; ++it) {
        const uint64_t b = std::max(lo, it->first), e = std::min(hi, it->second);
        // Unchanged whole chunks aren't read again soon; anything else is patched or hashed
        // next, while in cache.
        if (bounce_chunks && work[c].empty()) {
          StreamCopy(slot->data() + b, base->data() + b, e - b);
        } else {
          std::memcpy(slot->data() + b, base->data() + b, e - b);
        }
      }
      for (const auto& [step, chunk] : work[c]) {
        const delta::ChunkInfo& info = step->index.chunks[chunk];
        const uint8_t* payload = step->slot->data() + info.encoded_offset;
        absl::Status status =
            whole_chunks
                ? delta::ApplyChunk(step->index, chunk, payload, info.encoded_size, slot->data(),
                                    slot->size(), record)
                : delta::ApplyChunkWithin(step->index, chunk, payload, info.encoded_size,
                                          fetch.ranges, slot->data(), slot->size(), record);
        if (!status.ok()) return fail(std::move(status));
      }
      if (gather && !work[c].empty()) {
        GatherChunk(&changed_in[c], chain.size() > 1, slot->data(), fetch.bytes, &parts[c]);
      }
    }
  };
  const unsigned threads =
      std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16));
  std::vector<std::thread> pool;
  // Each thread orders its streaming stores before the slot is handed on.
  auto fenced = [&] {
    run();
    StoreFence();
  };
  for (unsigned t = 1; t < threads && t < num_chunks; ++t) pool.emplace_back(fenced);
  fenced();
  for (std::thread& t : pool) t.join();
  RETURN_IF_ERROR(failed);
  if (gather) *changes = JoinChunks(std::move(parts));
  return slot;
}

// Each step's payload read into its slot: from the origin, or (relaying) stripe by stripe from
// the node its stripe's tree names, the rest of it from the origin.
struct PayloadReads {
  std::vector<absl::Status> status;  // per step
  std::vector<Ranges> relayed;       // per step: what relays served
};

PayloadReads ReadPayloads(const PullJob& job, const PullJob& delta_job,
                          const std::vector<Step>& steps, const std::vector<bool>& use,
                          DataPlane* data_plane, const DeltaRelays* relays, DeltaResult* result) {
  PayloadReads out;
  out.status.resize(steps.size());
  out.relayed.resize(steps.size());
  std::vector<std::vector<std::future<absl::Status>>> origin(steps.size());
  struct Part {
    size_t step;
    std::string relay;
    std::future<RelayReadResult> result;
  };
  std::vector<Part> parts;
  std::vector<DataPlane::Landed> landed(steps.size());
  const bool relaying = relays && relays->board && relays->stub && relays->view.Relaying();
  for (size_t s = 0; s < steps.size(); ++s) {
    const Step& step = steps[s];
    if (!use[step.fetch] || step.payload.empty()) continue;
    if (!relaying) {
      origin[s].push_back(data_plane->Refetch(delta_job, s, step.payload, step.slot));
      continue;
    }
    PullJob::Fetch piece = delta_job.fetches[s];
    piece.buffer_id = DeltaPieceId(job.fetches[step.fetch].buffer_id, step.ref.base_version);
    piece.ranges = step.payload;
    const fleet::RelayKey key{job.model, job.version, piece.node, piece.buffer_id};
    relays->board->Begin(key, step.slot, step.ref.bytes, step.payload);
    landed[s] = [board = relays->board, key](uint64_t offset, uint64_t length) {
      board->Landed(key, offset, length);
    };
    for (auto& [parent, ranges] : ByParent(piece, relays->view)) {
      if (parent == piece.node) {
        origin[s].push_back(data_plane->Read(delta_job.fetches[s], ranges, step.slot, landed[s]));
        continue;
      }
      RelayReadRequest request{
          relays->view.self, job.model, job.version,       piece,         parent, ranges,
          step.slot,         landed[s], relays->view.site, StreamLimits{}};
      v1::Peer::Stub* stub = relays->stub(parent);
      parts.push_back({s, parent, std::async(std::launch::async, [request, stub, data_plane] {
                         return ReadFromRelay(request, stub, data_plane);
                       })});
    }
  }
  for (Part& part : parts) {
    RelayReadResult read = part.result.get();
    const Step& step = steps[part.step];
    if (read.bytes > 0) {
      Ranges& got = out.relayed[part.step];
      got.insert(got.end(), read.read.begin(), read.read.end());
      result->relayed[part.relay] += read.bytes;
      result->from_relays[step.fetch] += read.bytes;
    }
    if (read.leftover.empty()) continue;
    Logger("delta")->log(read.failed ? spdlog::level::warn : spdlog::level::debug,
                         "model={} version={} relay={}: reading {} bytes of the delta from "
                         "version {} of piece {} from node {} instead ({})",
                         job.model, job.version, part.relay, Total(read.leftover),
                         step.ref.base_version, job.fetches[step.fetch].buffer_id,
                         job.fetches[step.fetch].node, read.why);
    origin[part.step].push_back(data_plane->Read(delta_job.fetches[part.step], read.leftover,
                                                 step.slot, landed[part.step]));
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    for (auto& read : origin[s]) {
      absl::Status status = read.get();
      if (out.status[s].ok() && !status.ok()) out.status[s] = std::move(status);
    }
    Merge(&out.relayed[s]);
  }
  return out;
}

// A chain whose relayed delta bytes failed to apply: those chunks read again from the origin
// (the header, from the origin, holds their checksums), counted as rejected.
absl::Status RefetchRelayed(const PullJob& job, const PullJob& delta_job,
                            const std::vector<Step>& steps, const PayloadReads& reads, size_t fetch,
                            DataPlane* data_plane, Metrics* metrics) {
  uint64_t rejected = 0;
  std::vector<std::future<absl::Status>> again;
  for (size_t s = 0; s < steps.size(); ++s) {
    if (steps[s].fetch != fetch || reads.relayed[s].empty()) continue;
    for (size_t c : steps[s].chunks) {
      const delta::ChunkInfo& info = steps[s].index.chunks[c];
      const Ranges chunk = {{info.encoded_offset, info.encoded_offset + info.encoded_size}};
      rejected += Intersect(chunk, reads.relayed[s]).empty() ? 0 : 1;
    }
    again.push_back(data_plane->Refetch(delta_job, s, reads.relayed[s], steps[s].slot));
  }
  if (again.empty()) return absl::NotFoundError("nothing of it came from a relay");
  metrics->Add(kRelayChunksRejected, static_cast<double>(rejected));
  Logger("delta")->warn(
      "model={} version={} buffer={}: {} delta chunks from relays fail node "
      "{}'s checksums; reading them from node {}",
      job.model, job.version, job.fetches[fetch].buffer_id, rejected, job.fetches[fetch].node,
      job.fetches[fetch].node);
  absl::Status status;
  for (auto& read : again) {
    absl::Status s = read.get();
    if (status.ok() && !s.ok()) status = std::move(s);
  }
  return status;
}

}  // namespace

std::string DeltaPieceId(const std::string& buffer_id, uint64_t base_version) {
  return absl::StrCat(buffer_id, "/delta-from-", base_version);
}

DeltaResult FetchDeltas(const PullJob& job, DataPlane* data_plane, PullLanding* store,
                        double threshold, Metrics* metrics, const DeltaRelays* relays) {
  DeltaResult result;
  result.from_relays.assign(job.fetches.size(), 0);
  result.staging.resize(job.fetches.size());
  result.changes.resize(job.fetches.size());
  result.wire.assign(job.fetches.size(), 0);
  result.verified.assign(job.fetches.size(), false);
  std::vector<Step> steps;
  // Per fetch: the base (the held copy, or one rebuilt from the destinations).
  std::vector<std::shared_ptr<Region>> bases(job.fetches.size());
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    const PullJob::Fetch& fetch = job.fetches[f];
    if ((!fetch.base && !fetch.destination_base) || fetch.deltas.empty() || threshold <= 0) {
      continue;
    }
    // Whole deltas at most `threshold` of the whole piece, or the part this node needs would
    // rarely be either: decided before reading a byte of them.
    uint64_t total = 0;
    bool sane = true;
    for (const RemoteDeltaRef& ref : fetch.deltas) {
      // Sizes are a peer's claims: a sum that wraps is no delta worth fetching.
      sane = sane && ref.bytes >= delta::kFixedHeaderBytes &&
             !__builtin_add_overflow(total, ref.bytes, &total);
    }
    if (!sane) continue;
    if (static_cast<double>(total) > threshold * static_cast<double>(fetch.bytes)) {
      Logger("delta")->info(
          "model={} version={} buffer={}: deltas of {} bytes exceed {} x {}; "
          "pulling in full",
          job.model, job.version, fetch.buffer_id, total, threshold, fetch.bytes);
      metrics->Add(kDeltaFallbacks, 1);
      continue;
    }
    if (fetch.destination_base) {
      // --delta-base=destination: the engine's buffers, checked against the version's digests.
      auto rebuilt = store->BaseFromDestinations(job.model, fetch);
      if (!rebuilt.ok()) {
        Logger("delta")->warn(
            "model={} version={} buffer={}: the destinations can't be the "
            "delta base, pulling in full: {}",
            job.model, job.version, fetch.buffer_id, std::string(rebuilt.status().message()));
        metrics->Add(kDeltaBaseFallbacks, 1);
        continue;
      }
      bases[f] = std::move(rebuilt).value();
    } else {
      bases[f] = fetch.base;
    }
    for (const RemoteDeltaRef& ref : fetch.deltas)
      steps.push_back({f, ref, nullptr, {}, {}, {}, 0});
  }
  if (steps.empty()) return result;
  auto fail_all = [&](const absl::Status& status) {
    Logger("delta")->warn("model={} version={}: deltas unusable, pulling in full: {}", job.model,
                          job.version, status.ToString());
    metrics->Add(kDeltaFallbacks, 1);
    DeltaResult none;
    none.staging.resize(job.fetches.size());
    none.changes.resize(job.fetches.size());
    none.wire.assign(job.fetches.size(), 0);
    none.verified.assign(job.fetches.size(), false);
    none.from_relays.assign(job.fetches.size(), 0);
    return none;
  };
  // 1. The fixed part of every header, which says how long the header is.
  std::vector<Ranges> fixed(steps.size(), Ranges{{0, delta::kFixedHeaderBytes}});
  const PullJob delta_job = DeltaJob(job, steps, fixed);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto slots = data_plane->Pull(delta_job, Allocate).get();
  if (!slots.ok()) return fail_all(slots.status());
  for (size_t s = 0; s < steps.size(); ++s) steps[s].slot = (*slots)[s];
  // 2. The rest of the headers, and the chunks each fetch needs.
  absl::Status planned = PlanSteps(job, delta_job, data_plane, steps);
  if (!planned.ok()) return fail_all(planned);
  std::vector<bool> use(job.fetches.size(), false);
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    uint64_t wire = 0, needed = 0, chain = 0;
    for (const Step& step : steps) {
      if (step.fetch == f) wire += step.wire, ++chain;
    }
    if (chain == 0) continue;
    for (const auto& [b, e] : job.fetches[f].ranges) needed += e - b;
    use[f] = static_cast<double>(wire) <= threshold * static_cast<double>(needed);
    if (!use[f]) {
      Logger("delta")->info(
          "model={} version={} buffer={}: {} delta bytes exceed {} x {} "
          "needed; pulling in full",
          job.model, job.version, job.fetches[f].buffer_id, wire, threshold, needed);
      metrics->Add(kDeltaFallbacks, 1);
    }
  }
  const auto t1 = Clock::now();
  // 3. The chunks.
  const PayloadReads reads = ReadPayloads(job, delta_job, steps, use, data_plane, relays, &result);
  const auto t2 = Clock::now();
  // 4. Base + deltas -> staging, per fetch.
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (!use[f]) continue;
    std::vector<const Step*> chain;
    absl::Status status;
    uint64_t wire = 0;
    for (size_t s = 0; s < steps.size(); ++s) {
      if (steps[s].fetch != f) continue;
      chain.push_back(&steps[s]);
      wire += steps[s].wire;
      if (status.ok()) status = reads.status[s];
    }
    const bool whole = WholeChunks(job.fetches[f], chain);
    std::shared_ptr<const ChangeList> changes;
    absl::StatusOr<std::shared_ptr<Region>> built =
        status.ok() ? Build(job.fetches[f], bases[f], chain, whole, job.fetches[f].destination_base,
                            store, &changes)
                    : absl::StatusOr<std::shared_ptr<Region>>(status);
    // Relayed chunks that failed are read again from the origin and the delta rebuilt — not
    // over a destination base, which an in-place build has already changed (a full pull then).
    if (!built.ok() && status.ok() && !job.fetches[f].destination_base &&
        RefetchRelayed(job, delta_job, steps, reads, f, data_plane, metrics).ok()) {
      changes = nullptr;
      built = Build(job.fetches[f], bases[f], chain, whole, false, store, &changes);
    }
    if (!built.ok()) {
      Logger("delta")->warn(
          "model={} version={} buffer={}: delta from version {} failed, "
          "pulling in full: {}",
          job.model, job.version, job.fetches[f].buffer_id, job.fetches[f].base_version,
          built.status().ToString());
      metrics->Add(kDeltaFallbacks, 1);
      continue;
    }
    metrics->Add(kDeltaBytesReceived, static_cast<double>(wire));
    const auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    Logger("delta")->debug(
        "model={} version={} buffer={}: {} delta bytes ({} step(s) from "
        "version {}) instead of the full ranges; headers {:.1f} ms, chunks "
        "{:.1f} ms, staging built {:.1f} ms",
        job.model, job.version, job.fetches[f].buffer_id, wire, chain.size(),
        job.fetches[f].base_version, ms(t0, t1), ms(t1, t2), ms(t2, Clock::now()));
    result.staging[f] = std::move(built).value();
    result.changes[f] = std::move(changes);
    result.wire[f] = wire;
    result.verified[f] = whole;
  }
  return result;
}

}  // namespace refit::pull
