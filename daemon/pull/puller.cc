#include "daemon/pull/puller.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/memory/checksum.h"
#include "daemon/pull/delta_fetch.h"
#include "daemon/pull/relay_read.h"
#include "grpcpp/grpcpp.h"

namespace refit::pull {
namespace {

using std::chrono::milliseconds;
constexpr auto kCallDeadline = milliseconds(10000);
// Per Checksum call: ranges (8 B each in the reply: 2 MiB, under gRPC's default 4 MiB message
// limit) and runs (up to ~40 B each in the request).
constexpr uint64_t kRangesPerChecksumCall = 1u << 18;
constexpr size_t kRunsPerChecksumCall = 1u << 16;
constexpr int kFetchTries = 3;

std::chrono::system_clock::time_point In(milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

// Verification works in the data plane's chunk units, so a mismatch refetches little.
std::vector<std::pair<uint64_t, uint64_t>> VerifyChunks(const PullJob::Fetch& fetch) {
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (const auto& [begin, end] : fetch.ranges) {
    // On the source's checksum grid (whole pieces are ranges from 0): answered from the
    // checksums it took at Publish.
    for (uint64_t off = begin; off < end; off += kChecksumChunkBytes) {
      chunks.emplace_back(off, std::min<uint64_t>(end, off + kChecksumChunkBytes));
    }
  }
  return chunks;
}

grpc::Status CallChecksum(v1::Peer::Stub* stub, const v1::ChecksumRequest& request,
                          v1::ChecksumResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(In(kCallDeadline));
  return stub->Checksum(&context, request, response);
}

}  // namespace

struct Puller::Sources {
  // Per job fetch: the ranges read from each relay.
  std::vector<std::map<std::string, Ranges>> relayed;
};

Puller::Puller(PullerOptions options, PullLanding* store, dataplane::DataPlane* data_plane,
               Metrics* metrics, PeerChannels* channels, fleet::RelayBoard* board,
               fleet::ReplicaTable* replicas)
    : options_(std::move(options)),
      store_(store),
      data_plane_(data_plane),
      metrics_(metrics),
      counters_(metrics),
      channels_(channels),
      board_(board),
      replicas_(replicas) {}

Puller::Counters::Counters(Metrics* metrics)
    : delta_versions(metrics->Declare(kDeltaVersions)),
      full_versions(metrics->Declare(kFullVersions)),
      relay_bytes_received(metrics->Declare(kRelayBytesReceived)),
      relay_chunks_rejected(metrics->Declare(kRelayChunksRejected)),
      chunks_refetched(metrics->Declare(kChunksRefetched)),
      site_bytes_received(metrics->Declare(kSiteBytesReceived)),
      relay_failovers(metrics->Declare(kRelayFailovers)) {
  // Counted by FetchDeltas (delta_fetch.cc), by name.
  metrics->Declare(kDeltaBytesReceived);
  metrics->Declare(kDeltaFallbacks);
}

absl::Status Puller::PinOn(const std::string& node, const PullJob& job, bool release,
                           uint64_t bytes_read, bool relay) {
  v1::Peer::Stub* stub = channels_->StubFor(node);
  if (!stub) return absl::UnavailableError(absl::StrCat("node ", node, " is not connected"));
  v1::PinRequest request;
  request.set_model(job.model);
  request.set_version(job.version);
  request.set_node(options_.node);
  request.set_release(release);
  request.set_lease_ms(options_.pin_lease_ms);
  request.set_bytes_read(release ? bytes_read : 0);
  request.set_relay(relay);
  v1::PinResponse response;
  grpc::ClientContext context;
  context.set_deadline(In(kCallDeadline));
  grpc::Status s = stub->Pin(&context, request, &response);
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("node ", node, ": ", s.error_message()));
}

fleet::SiteView Puller::View(const PullJob& job) {
  fleet::SiteView view;
  view.self = options_.node;
  view.site = options_.site;
  view.fanout = options_.fanout;
  view.local = {options_.node};
  if (!options_.relay || !replicas_) return view;
  for (auto& [site, nodes] : replicas_->RelaysBySite(job.model)) {
    std::vector<std::string> reachable;
    for (const std::string& node : nodes) {
      if (node != options_.node && channels_->CanReach(node)) reachable.push_back(node);
    }
    if (site == options_.site) {
      view.local.insert(view.local.end(), reachable.begin(), reachable.end());
    } else if (!reachable.empty()) {
      view.remote[site] = std::move(reachable);
    }
  }
  // Test build only: this node sees no other puller of its site, as a node whose view of the
  // site differs from the others' would (tests/fleet_sites_test: two entries into one site).
  if (TestSwitch("REFIT_TEST_SITE_ALONE")) view.local = {options_.node};
  std::sort(view.local.begin(), view.local.end());
  for (const auto& fetch : job.fetches) {
    if (!view.origin_sites.count(fetch.node)) {
      view.origin_sites[fetch.node] = channels_->SiteOf(fetch.node);
    }
  }
  if (!options_.site.empty() && view.local.size() == 1 && !view.remote.empty()) {
    bool first = false;
    {
      common::MutexLock lock(warned_mu_);
      if (warned_alone_.size() >= 1024) warned_alone_.clear();
      first = warned_alone_.insert(job.model).second;
    }
    if (first) {
      std::string others;
      for (const auto& [site, nodes] : view.remote) {
        absl::StrAppend(&others, others.empty() ? "" : ", ", "'", site, "' (", nodes.size(),
                        nodes.size() == 1 ? " node)" : " nodes)");
      }
      Logger("peer")->warn(
          "model={}: node {} is the only node of site '{}' pulling it (other sites: {}); it "
          "reads every version across sites itself and relays it to no one of its site: check "
          "its --site",
          job.model, options_.node, options_.site, others);
    }
  }
  return view;
}

namespace {

// Test build only: a slowed engine node (tests/rl_semantics_test). Each pull first waits
// $REFIT_FAULT_PULL_DELAY_MS while the file $REFIT_FAULT_PULL_DELAY_FILE exists (always,
// without that variable); removing the file ends the wait at once.
void FaultPullDelay() {
  const char* ms = TestSwitch("REFIT_FAULT_PULL_DELAY_MS");
  if (!ms) return;
  const char* file = TestSwitch("REFIT_FAULT_PULL_DELAY_FILE");
  const auto until = std::chrono::steady_clock::now() + milliseconds(std::atoll(ms));
  while (std::chrono::steady_clock::now() < until && (!file || access(file, F_OK) == 0)) {
    std::this_thread::sleep_for(milliseconds(10));
  }
}

}  // namespace

PullOutcome Puller::Pull(const PullJob& job) {
  FaultPullDelay();
  // The board's hold on the previous version's slots goes before this pull asks for its own.
  if (board_) board_->Retire(job.model, job.version);
  const int64_t started_us = rl::WallMicros();
  PullOutcome outcome;
  std::vector<std::shared_ptr<Region>>& staging = outcome.staging;
  auto finish = [&](absl::Status status) {
    if (board_) board_->End(job.model, job.version, status.ok());
    outcome.status = std::move(status);
    if (!outcome.status.ok()) staging.clear();
    return std::move(outcome);
  };
  // Pin the version on every node we read from, so --retain there can't free it under us.
  std::map<std::string, uint64_t> bytes_from;
  for (const auto& f : job.fetches) {
    for (const auto& [b, e] : f.ranges) bytes_from[f.node] += e - b;
  }
  for (const auto& [node, bytes] : bytes_from) {
    absl::Status pinned = PinOn(node, job, false, 0, false);
    if (!pinned.ok()) return finish(pinned);
  }

  // Where a pull's time goes, for the debug log.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point pinned = Clock::now();
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  // Pieces this node can bring up to date from an older version by deltas; the rest in full.
  // Their chunks, too, come from relays where other nodes pull the same delta.
  const fleet::SiteView view = View(job);
  DeltaRelays relays{view, board_,
                     [this](const std::string& node) { return channels_->StubFor(node); }};
  DeltaResult deltas = FetchDeltas(job, data_plane_, store_, options_.delta_threshold, metrics_,
                                   board_ ? &relays : nullptr);
  const double deltas_ms = ms_since(pinned);
  staging = std::move(deltas.staging);
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (staging[f] && deltas.changes[f]) store_->NoteDeltaChanges(job, f, deltas.changes[f]);
  }
  // fp8 engines: blocks are quantized as their bytes land, while the rest arrives.
  LandedQuantizer quantizer(store_, job);
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (!staging[f]) continue;
    quantizer.Staged(f, staging[f]);
    quantizer.Whole(f);
    bytes_from[job.fetches[f].node] += deltas.wire[f] - deltas.from_relays[f];
    bytes_from[job.fetches[f].node] -= Total(job.fetches[f].ranges);
  }
  std::map<std::string, uint64_t> relayed_from;  // for the timeline
  for (const auto& [relay, bytes] : deltas.relayed) {
    relayed_from[relay] += bytes;
    counters_.relay_bytes_received.Add(static_cast<double>(bytes));
    if (view.Across(relay)) counters_.site_bytes_received.Add(static_cast<double>(bytes));
    (void)PinOn(relay, job, true, bytes, true);
  }
  // The origin hashes what we read while the bytes are still moving (not what deltas already
  // verified chunk by chunk).
  const std::vector<bool> verified = deltas.verified;
  auto remote_sums = std::async(std::launch::async, [this, &job, verified] {
    std::vector<absl::StatusOr<std::vector<uint64_t>>> sums;
    for (size_t f = 0; f < job.fetches.size(); ++f) {
      sums.push_back(verified[f] ? std::vector<uint64_t>()
                                 : RemoteChecksums(job, f, VerifyChunks(job.fetches[f])));
    }
    return sums;
  });
  std::vector<size_t> full_index;
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (!staging[f]) full_index.push_back(f);
  }
  const bool used_delta = full_index.size() < job.fetches.size();
  absl::Status status;
  dataplane::DataPlane::ReadHashes hashes(job.fetches.size());  // by the job's fetch index
  Sources sources;
  sources.relayed.resize(job.fetches.size());
  if (!full_index.empty() && view.Relaying()) {
    status = PullStriped(job, full_index, view, &staging, &sources, &hashes, &quantizer);
    for (size_t f : full_index) {
      for (const auto& [relay, ranges] : sources.relayed[f]) {
        bytes_from[job.fetches[f].node] -= Total(ranges);
      }
    }
  } else if (!full_index.empty() && quantizer.active()) {
    // Read fetch by fetch into slots taken here, so that what lands is known as it lands.
    std::vector<std::pair<size_t, std::future<absl::Status>>> reads;
    std::vector<std::shared_ptr<dataplane::DataPlane::ReadHashes>> read_hashes;
    for (size_t f : full_index) {
      auto slot = store_->AcquireSlot(job.fetches[f].bytes);
      if (!slot.ok()) {
        status = slot.status();
        break;
      }
      staging[f] = *slot;
      quantizer.Staged(f, *slot);
      read_hashes.push_back(std::make_shared<dataplane::DataPlane::ReadHashes>());
      reads.emplace_back(f, data_plane_->Read(
                                job.fetches[f], job.fetches[f].ranges, *slot,
                                [&quantizer, f](uint64_t offset, uint64_t length) {
                                  quantizer.Landed(f, offset, length);
                                },
                                read_hashes.back()));
    }
    for (size_t i = 0; i < reads.size(); ++i) {
      std::future<absl::Status>& read = reads[i].second;
      while (read.wait_for(milliseconds(options_.pin_lease_ms / 4)) != std::future_status::ready) {
        for (const auto& [node, bytes] : bytes_from) (void)PinOn(node, job, false, 0, false);
      }
      absl::Status s = read.get();
      if (status.ok() && !s.ok()) status = s;
      if (s.ok() && !read_hashes[i]->empty()) hashes[reads[i].first] = (*read_hashes[i])[0];
    }
  } else if (!full_index.empty()) {
    PullJob full = job;
    full.fetches.clear();
    for (size_t f : full_index) full.fetches.push_back(job.fetches[f]);
    auto read_hashes = std::make_shared<dataplane::DataPlane::ReadHashes>();
    auto pulling = data_plane_->Pull(
        full, [this](uint64_t size) { return store_->AcquireSlot(size); }, read_hashes);
    // A long pull (a large model over a slow link) renews its pins before their lease lapses,
    // so no source recycles a slot while it is being read.
    while (pulling.wait_for(milliseconds(options_.pin_lease_ms / 4)) != std::future_status::ready) {
      for (const auto& [node, bytes] : bytes_from) (void)PinOn(node, job, false, 0, false);
    }
    auto result = pulling.get();
    status = result.status();
    if (result.ok()) {
      for (size_t i = 0; i < full_index.size(); ++i) {
        staging[full_index[i]] = (*result)[i];
        hashes[full_index[i]] = std::move((*read_hashes)[i]);
      }
    }
  }
  const double data_ms = ms_since(pinned) - deltas_ms;
  auto sums = remote_sums.get();
  const double sums_wait_ms = ms_since(pinned) - deltas_ms - data_ms;
  const int64_t pulled_us = rl::WallMicros();
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> refetched(job.fetches.size());
  if (status.ok()) {
    status = Verify(job, staging, hashes, std::move(sums), verified, sources, &refetched);
  }
  if (status.ok()) quantizer.Finish(refetched);  // blocks of refetched ranges quantized again
  if (options_.timeline) {
    for (const auto& fetch_relays : sources.relayed) {
      for (const auto& [relay, ranges] : fetch_relays) relayed_from[relay] += Total(ranges);
    }
    std::string from;
    for (const auto& [node, bytes] : bytes_from) {
      if (bytes > 0) absl::StrAppend(&from, from.empty() ? "" : ", ", node, " ", bytes);
    }
    for (const auto& [node, bytes] : relayed_from) {
      if (bytes > 0) absl::StrAppend(&from, from.empty() ? "" : ", ", node, " (relay) ", bytes);
    }
    options_.timeline->Record(
        job.model, job.version, rl::kStagePulled, started_us, pulled_us,
        absl::StrCat("from ", from.empty() ? "nobody" : from, " bytes",
                     used_delta ? " (delta)" : "", status.ok() ? "" : "; failed"));
    if (status.ok()) {
      options_.timeline->Record(job.model, job.version, rl::kStageVerified, pulled_us,
                                rl::WallMicros(), "XXH3 against the origin's");
    }
  }
  Logger("peer")->debug(
      "model={} version={} pull phases: deltas {:.1f} ms, data {:.1f} ms, then waited {:.1f} ms "
      "for the source's checksums, verify {:.1f} ms",
      job.model, job.version, deltas_ms, data_ms, sums_wait_ms,
      ms_since(pinned) - deltas_ms - data_ms - sums_wait_ms);
  for (const auto& [node, bytes] : bytes_from) {
    (void)PinOn(node, job, true, bytes, false);
    if (view.Across(node)) counters_.site_bytes_received.Add(static_cast<double>(bytes));
  }
  if (status.ok()) TestHookKillAt("pull_complete");  // test build only: a commit point
  if (status.ok()) (used_delta ? counters_.delta_versions : counters_.full_versions).Add(1);
  return finish(status);
}

absl::Status Puller::PullStriped(const PullJob& job, const std::vector<size_t>& full,
                                 const fleet::SiteView& view,
                                 std::vector<std::shared_ptr<Region>>* staging, Sources* sources,
                                 dataplane::DataPlane::ReadHashes* hashes,
                                 LandedQuantizer* quantizer) {
  struct Part {
    size_t fetch;
    std::string relay;
    Ranges ranges;
  };
  std::vector<Part> relay_parts;
  // Each read hashes what it brought as it lands, as a plain pull does, so verifying needs no
  // second pass over what came from the origin.
  struct OriginRead {
    size_t fetch;
    std::future<absl::Status> done;
    std::shared_ptr<dataplane::DataPlane::ReadHashes> hashes;
  };
  std::vector<OriginRead> origin_reads;
  std::vector<dataplane::DataPlane::Landed> landed(job.fetches.size());
  for (size_t f : full) {
    const PullJob::Fetch& fetch = job.fetches[f];
    auto slot = store_->AcquireSlot(fetch.bytes);
    if (!slot.ok()) return slot.status();
    (*staging)[f] = *slot;
    quantizer->Staged(f, *slot);
    const fleet::RelayKey key{job.model, job.version, fetch.node, fetch.buffer_id};
    if (board_) {
      board_->Begin(key, *slot, fetch.bytes, fetch.ranges);
      landed[f] = [board = board_, key, quantizer, f](uint64_t offset, uint64_t length) {
        board->Landed(key, offset, length);
        quantizer->Landed(f, offset, length);
      };
    } else if (quantizer->active()) {
      landed[f] = [quantizer, f](uint64_t offset, uint64_t length) {
        quantizer->Landed(f, offset, length);
      };
    }
    for (auto& [parent, ranges] : ByParent(fetch, view)) {
      if (parent == fetch.node) {
        // What this node reads from the origin here is the stripe (or the site's entry) other
        // nodes read from it: in --relay-chunk-bytes reads, which it serves on as each lands.
        auto hashes = std::make_shared<dataplane::DataPlane::ReadHashes>();
        origin_reads.push_back({f,
                                data_plane_->Read(fetch, ranges, *slot, landed[f], hashes,
                                                  dataplane::DataPlane::ReadGrain::kRelayed),
                                hashes});
      } else {
        relay_parts.push_back({f, parent, std::move(ranges)});
      }
    }
  }
  // Each relay's stripes on a thread of their own: their reads are posted as the relay
  // announces what landed there.
  std::vector<std::future<RelayReadResult>> relayed;
  for (const Part& part : relay_parts) {
    RelayReadRequest request{options_.node,           job.model,          job.version,
                             job.fetches[part.fetch], part.relay,         part.ranges,
                             (*staging)[part.fetch],  landed[part.fetch], options_.site,
                             options_.relay_limits};
    relayed.push_back(std::async(std::launch::async, [this, request] {
      return ReadFromRelay(request, channels_->StubFor(request.relay), data_plane_);
    }));
  }
  // Each relay's result as soon as it is in: what a relay that failed (its stream ends when its
  // process dies) still owed is read from the origin at once, beside this node's own reads
  // from the origin, not after them.
  std::vector<std::pair<size_t, std::future<absl::Status>>> again;
  std::vector<bool> handled(relay_parts.size(), false);
  for (size_t left = relay_parts.size(); left > 0;) {
    bool progressed = false;
    for (size_t i = 0; i < relay_parts.size(); ++i) {
      if (handled[i] || relayed[i].wait_for(milliseconds(0)) != std::future_status::ready) {
        continue;
      }
      handled[i] = true;
      --left;
      progressed = true;
      const Part& part = relay_parts[i];
      RelayReadResult result = relayed[i].get();
      if (result.bytes > 0) {
        sources->relayed[part.fetch][part.relay] = result.read;
        for (auto& [offset, sum] : result.hashes) (*hashes)[part.fetch][offset] = sum;
        counters_.relay_bytes_received.Add(static_cast<double>(result.bytes));
        if (view.Across(part.relay)) {
          counters_.site_bytes_received.Add(static_cast<double>(result.bytes));
        }
        (void)PinOn(part.relay, job, true, result.bytes, true);
      }
      if (result.leftover.empty()) continue;
      if (result.failed) counters_.relay_failovers.Add(1);
      // A relay of another layout holding only part of this node's ranges is normal (debug);
      // one that failed, stalled or went away is worth a warning.
      Logger("peer")->log(
          result.failed ? spdlog::level::warn : spdlog::level::debug,
          "model={} version={} relay={}: reading {} bytes of piece {} from node {} instead "
          "({})",
          job.model, job.version, part.relay, Total(result.leftover),
          job.fetches[part.fetch].buffer_id, job.fetches[part.fetch].node, result.why);
      again.emplace_back(part.fetch, data_plane_->Read(job.fetches[part.fetch], result.leftover,
                                                       (*staging)[part.fetch], landed[part.fetch]));
    }
    if (left > 0 && !progressed) {
      for (size_t i = 0; i < relay_parts.size(); ++i) {
        if (!handled[i]) {
          relayed[i].wait_for(milliseconds(5));
          break;
        }
      }
    }
  }
  absl::Status status;
  for (OriginRead& read : origin_reads) {
    absl::Status s = read.done.get();
    if (status.ok() && !s.ok()) status = s;
    if (s.ok() && !read.hashes->empty()) {
      for (auto& [offset, sum] : (*read.hashes)[0]) (*hashes)[read.fetch][offset] = sum;
    }
  }
  for (auto& [f, read] : again) {
    absl::Status s = read.get();
    if (status.ok() && !s.ok()) status = s;
  }
  return status;
}

absl::StatusOr<std::vector<uint64_t>> Puller::RemoteChecksums(
    const PullJob& job, size_t f, const std::vector<std::pair<uint64_t, uint64_t>>& chunks) {
  const PullJob::Fetch& fetch = job.fetches[f];
  const std::vector<RangeRun> runs = ToRuns(chunks);
  std::vector<uint64_t> sums;
  sums.reserve(chunks.size());
  size_t r = 0;
  uint64_t done_of_run = 0;  // ranges of runs[r] already asked for
  while (r < runs.size()) {
    v1::Peer::Stub* stub = channels_->StubFor(fetch.node);
    if (!stub) return absl::UnavailableError(absl::StrCat("node ", fetch.node, " went away"));
    v1::ChecksumRequest request;
    request.set_model(job.model);
    request.set_version(job.version);
    request.set_buffer_id(fetch.buffer_id);
    // Asked inside this node's grant: its pin of the version there (PinOn), and the remote key
    // that node sent this one.
    request.set_node(options_.node);
    request.set_remote_key(fetch.remote_key);
    uint64_t asked = 0;
    while (r < runs.size() && static_cast<size_t>(request.runs_size()) < kRunsPerChecksumCall &&
           asked < kRangesPerChecksumCall) {
      const RangeRun& run = runs[r];
      const uint64_t take = std::min(run.count - done_of_run, kRangesPerChecksumCall - asked);
      v1::RangeRun* out = request.add_runs();
      out->set_offset(run.offset + done_of_run * run.stride);
      out->set_length(run.length);
      out->set_stride(run.stride);
      out->set_count(take);
      asked += take;
      done_of_run += take;
      if (done_of_run == run.count) {
        ++r;
        done_of_run = 0;
      }
    }
    v1::ChecksumResponse response;
    grpc::Status s = CallChecksum(stub, request, &response);
    if (s.ok() && response.sums_size() == 0 && response.xxh3_size() == 0 && asked > 0) {
      // A source of an older release reads only plain ranges.
      v1::ChecksumRequest plain = request;
      plain.clear_runs();
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (const v1::RangeRun& run : request.runs()) {
        AppendRanges({run.offset(), run.length(), run.stride(), run.count()}, &ranges);
      }
      for (const auto& [begin, end] : ranges) {
        v1::ByteRange* range = plain.add_ranges();
        range->set_offset(begin);
        range->set_length(end - begin);
      }
      response.Clear();
      s = CallChecksum(stub, plain, &response);
      if (s.ok()) response.mutable_sums()->Add(response.xxh3().begin(), response.xxh3().end());
    }
    if (!s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("node ", fetch.node, " checksum: ", s.error_message()));
    }
    if (static_cast<uint64_t>(response.sums_size()) != asked) {
      return absl::DataLossError("checksum reply of the wrong length");
    }
    sums.insert(sums.end(), response.sums().begin(), response.sums().end());
  }
  return sums;
}

absl::Status Puller::Verify(const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
                            const dataplane::DataPlane::ReadHashes& read_hashes,
                            std::vector<absl::StatusOr<std::vector<uint64_t>>> remote,
                            const std::vector<bool>& verified, const Sources& sources,
                            std::vector<std::vector<std::pair<uint64_t, uint64_t>>>* refetched) {
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (verified[f]) continue;
    const PullJob::Fetch& fetch = job.fetches[f];
    std::vector<std::pair<uint64_t, uint64_t>> chunks = VerifyChunks(fetch);
    absl::StatusOr<std::vector<uint64_t>> sums = std::move(remote[f]);
    for (int attempt = 1;; ++attempt) {
      if (!sums.ok()) return sums.status();
      std::vector<std::pair<uint64_t, uint64_t>> bad;
      // The data plane hashed each read as it landed; a chunk no single read covered (another
      // --chunk-bytes, a refetch, a striped pull) is hashed here.
      std::vector<uint64_t> here(chunks.size());
      std::vector<std::pair<uint64_t, uint64_t>> unhashed;
      std::vector<size_t> unhashed_at;
      for (size_t i = 0; i < chunks.size(); ++i) {
        const auto& by_offset = read_hashes[f];
        auto it = attempt == 1 ? by_offset.find(chunks[i].first) : by_offset.end();
        if (it != by_offset.end() && it->second.first == chunks[i].second - chunks[i].first) {
          here[i] = it->second.second;
        } else {
          unhashed.push_back(chunks[i]);
          unhashed_at.push_back(i);
        }
      }
      const std::vector<uint64_t> hashed = HashRanges(staging[f]->data(), unhashed);
      for (size_t k = 0; k < hashed.size(); ++k) here[unhashed_at[k]] = hashed[k];
      for (size_t i = 0; i < chunks.size(); ++i) {
        if (here[i] != (*sums)[i]) bad.push_back(chunks[i]);
      }
      if (bad.empty()) break;
      if (attempt == 1) {
        // A relay that served bytes the origin's checksums refuse is not trusted again for
        // this version: what failed is fetched from the origin below.
        for (const auto& [relay, ranges] : sources.relayed[f]) {
          const uint64_t rejected = Intersect(bad, ranges).size();
          if (rejected == 0) continue;
          counters_.relay_chunks_rejected.Add(static_cast<double>(rejected));
          Logger("peer")->warn(
              "model={} version={} relay={} served {} chunks of piece {} that fail node {}'s "
              "checksums; reading them from node {}",
              job.model, job.version, relay, rejected, fetch.buffer_id, fetch.node, fetch.node);
        }
      }
      if (attempt >= kFetchTries) {
        return absl::DataLossError(absl::StrCat(
            "model ", job.model, " version ", job.version, ": ", bad.size(), " chunks from node ",
            fetch.node, " still fail their checksum after ", attempt, " fetches"));
      }
      Logger("peer")->warn(
          "model={} version={} node={} {} chunks failed their checksum; "
          "fetching them again",
          job.model, job.version, fetch.node, bad.size());
      counters_.chunks_refetched.Add(static_cast<double>(bad.size()));
      (*refetched)[f].insert((*refetched)[f].end(), bad.begin(), bad.end());
      absl::Status again = data_plane_->Refetch(job, f, bad, staging[f]).get();
      if (!again.ok()) return again;
      chunks = bad;
      sums = RemoteChecksums(job, f, chunks);
    }
  }
  return absl::OkStatus();
}

}  // namespace refit::pull
