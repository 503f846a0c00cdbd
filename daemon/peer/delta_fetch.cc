#include "daemon/peer/delta_fetch.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/delta/delta.h"

namespace refit::peer {
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
    out.fetches.push_back({f.node, f.buffer_id, steps[s].ref.remote_key, steps[s].ref.bytes,
                           ranges[s], nullptr, 0, {}});
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
    rest[s] = data_plane->Refetch(delta_job, s, {{delta::kFixedHeaderBytes, *size}},
                                  steps[s].slot);
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
      for (size_t c : delta::ChunksOverlapping(step.index, begin / es, (end - begin + es - 1) / es)) {
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

// Copies the base's needed ranges into a fresh slot and applies the fetch's steps in order.
absl::StatusOr<std::shared_ptr<Region>> Build(const PullJob::Fetch& fetch,
                                              const std::vector<const Step*>& chain,
                                              Store* store) {
  ASSIGN_OR_RETURN(std::shared_ptr<Region> slot, store->AcquireSlot(fetch.bytes));
  for (const auto& [begin, end] : fetch.ranges) {
    std::memcpy(slot->data() + begin, fetch.base->data() + begin, end - begin);
  }
  for (const Step* step : chain) {
    for (size_t c : step->chunks) {
      const delta::ChunkInfo& info = step->index.chunks[c];
      RETURN_IF_ERROR(delta::ApplyChunkWithin(step->index, c,
                                              step->slot->data() + info.encoded_offset,
                                              info.encoded_size, fetch.ranges, slot->data(),
                                              slot->size()));
    }
  }
  return slot;
}

}  // namespace

std::vector<std::shared_ptr<Region>> FetchDeltas(const PullJob& job, DataPlane* data_plane,
                                                 Store* store, double threshold,
                                                 Metrics* metrics, std::vector<uint64_t>* wire_out) {
  std::vector<std::shared_ptr<Region>> out(job.fetches.size());
  wire_out->assign(job.fetches.size(), 0);
  std::vector<Step> steps;
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    const PullJob::Fetch& fetch = job.fetches[f];
    if (!fetch.base || fetch.deltas.empty() || threshold <= 0) continue;
    // Whole deltas at most `threshold` of the whole piece, or the part this node needs would
    // rarely be either: decided before reading a byte of them.
    uint64_t total = 0;
    bool sane = true;
    for (const RemoteDeltaRef& ref : fetch.deltas) {
      total += ref.bytes;
      sane = sane && ref.bytes >= delta::kFixedHeaderBytes;
    }
    if (!sane) continue;
    if (static_cast<double>(total) > threshold * static_cast<double>(fetch.bytes)) {
      Logger("delta")->info("model={} version={} buffer={}: deltas of {} bytes exceed {} x {}; "
                            "pulling in full",
                            job.model, job.version, fetch.buffer_id, total, threshold,
                            fetch.bytes);
      metrics->Add(kDeltaFallbacks, 1);
      continue;
    }
    for (const RemoteDeltaRef& ref : fetch.deltas) steps.push_back({f, ref, nullptr, {}, {}, {}, 0});
  }
  if (steps.empty()) return out;
  auto fail_all = [&](const absl::Status& status) {
    Logger("delta")->warn("model={} version={}: deltas unusable, pulling in full: {}", job.model,
                          job.version, status.ToString());
    metrics->Add(kDeltaFallbacks, 1);
    return std::vector<std::shared_ptr<Region>>(job.fetches.size());
  };
  // 1. The fixed part of every header, which says how long the header is.
  std::vector<Ranges> fixed(steps.size(), Ranges{{0, delta::kFixedHeaderBytes}});
  const PullJob delta_job = DeltaJob(job, steps, fixed);
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
      Logger("delta")->info("model={} version={} buffer={}: {} delta bytes exceed {} x {} "
                            "needed; pulling in full",
                            job.model, job.version, job.fetches[f].buffer_id, wire, threshold,
                            needed);
      metrics->Add(kDeltaFallbacks, 1);
    }
  }
  // 3. The chunks.
  std::vector<std::future<absl::Status>> reads(steps.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    if (use[steps[s].fetch] && !steps[s].payload.empty()) {
      reads[s] = data_plane->Refetch(delta_job, s, steps[s].payload, steps[s].slot);
    }
  }
  std::vector<absl::Status> read_status(steps.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    if (reads[s].valid()) read_status[s] = reads[s].get();
  }
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
      if (status.ok()) status = read_status[s];
    }
    absl::StatusOr<std::shared_ptr<Region>> built =
        status.ok() ? Build(job.fetches[f], chain, store) : absl::StatusOr<std::shared_ptr<Region>>(status);
    if (!built.ok()) {
      Logger("delta")->warn("model={} version={} buffer={}: delta from version {} failed, "
                            "pulling in full: {}",
                            job.model, job.version, job.fetches[f].buffer_id,
                            job.fetches[f].base_version, built.status().ToString());
      metrics->Add(kDeltaFallbacks, 1);
      continue;
    }
    metrics->Add(kDeltaBytesReceived, static_cast<double>(wire));
    Logger("delta")->debug("model={} version={} buffer={}: {} delta bytes ({} step(s) from "
                           "version {}) instead of the full ranges",
                           job.model, job.version, job.fetches[f].buffer_id, wire, chain.size(),
                           job.fetches[f].base_version);
    out[f] = std::move(built).value();
    (*wire_out)[f] = wire;
  }
  return out;
}

}  // namespace refit::peer
