#include "daemon/pull/relay_read.h"

#include <algorithm>
#include <chrono>
#include <future>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/fleet/stripes.h"
#include "daemon/memory/checksum.h"
#include "daemon/pull/stream_watchdog.h"
#include "grpcpp/grpcpp.h"

namespace refit::pull {
namespace {

// A relay that announces nothing new for StreamLimits::stall (30 s), while this side still waits
// on it, is given up on for the rest of the version (its stripe then comes from the origin); one
// that sends nothing at all for StreamLimits::silence (10 s; a live relay writes at least every
// 500 ms) too: its connection may stay up (keepalive answered) while it never writes. A relay
// that went away is noticed sooner, by its stream: a dead process's connection closes at once, a
// hung host misses the channel's keepalive (1 s, answered within 2 s). A live relay that is slow
// is slow because what it reads comes slowly (another site's link, its own parent): reading from
// the origin instead would not be faster, and across sites it would send the stripe over the slow
// link a second time.
// The whole stream, however long the pull.
constexpr auto kStreamDeadline = std::chrono::minutes(30);

Ranges FromProto(const google::protobuf::RepeatedPtrField<v1::ByteRange>& in, uint64_t bytes) {
  Ranges out;
  for (const v1::ByteRange& r : in) {
    if (r.length() == 0 || r.offset() >= bytes || r.length() > bytes - r.offset()) continue;
    out.emplace_back(r.offset(), r.offset() + r.length());
  }
  Merge(&out);
  return out;
}

}  // namespace

void Merge(Ranges* ranges) {
  std::sort(ranges->begin(), ranges->end());
  Ranges merged;
  for (const auto& r : *ranges) {
    if (r.first >= r.second) continue;
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges->swap(merged);
}

Ranges Intersect(const Ranges& a, const Ranges& b) {
  Ranges out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t begin = std::max(a[i].first, b[j].first);
    const uint64_t end = std::min(a[i].second, b[j].second);
    if (begin < end) out.emplace_back(begin, end);
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

Ranges Subtract(const Ranges& a, const Ranges& b) {
  Ranges out;
  size_t j = 0;
  for (auto [begin, end] : a) {
    while (j < b.size() && b[j].second <= begin) ++j;
    size_t k = j;
    while (begin < end && k < b.size() && b[k].first < end) {
      if (b[k].first > begin) out.emplace_back(begin, b[k].first);
      begin = std::max(begin, b[k].second);
      ++k;
    }
    if (begin < end) out.emplace_back(begin, end);
  }
  return out;
}

std::map<std::string, Ranges> ByParent(const PullJob::Fetch& fetch, const fleet::SiteView& view) {
  const uint64_t salt = fleet::PieceSalt(fetch.node, fetch.buffer_id);
  std::map<std::string, Ranges> out;
  for (const auto& [begin, end] : fetch.ranges) {
    for (uint64_t off = begin; off < end;) {
      const uint64_t chunk = off / kChecksumChunkBytes;
      const uint64_t stop = std::min(end, (chunk + 1) * kChecksumChunkBytes);
      Ranges& to = out[fleet::SourceOf(view, fetch.node, chunk, salt)];
      if (!to.empty() && to.back().second == off) {
        to.back().second = stop;
      } else {
        to.emplace_back(off, stop);
      }
      off = stop;
    }
  }
  return out;
}

uint64_t Total(const Ranges& ranges) {
  uint64_t total = 0;
  for (const auto& [b, e] : ranges) total += e - b;
  return total;
}

RelayReadResult ReadFromRelay(const RelayReadRequest& request, v1::Peer::Stub* stub,
                              dataplane::DataPlane* data_plane) {
  RelayReadResult result;
  if (!stub) {
    result.leftover = request.wanted;
    result.failed = true;
    result.why = "not connected";
    return result;
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kStreamDeadline);
  v1::RelayRequest ask;
  ask.set_model(request.model);
  ask.set_version(request.version);
  ask.set_node(request.self);
  ask.set_origin(request.fetch.node);
  ask.set_buffer_id(request.fetch.buffer_id);
  ask.set_site(request.site);
  for (const auto& [begin, end] : request.wanted) {
    v1::ByteRange* range = ask.add_wanted();
    range->set_offset(begin);
    range->set_length(end - begin);
  }
  auto stream = stub->Relay(&context, ask);
  StreamWatchdog watchdog(&context, request.limits);

  Ranges pending;  // wanted, not yet asked of the data plane
  Ranges landed;   // what the relay says it has (merged)
  struct Posted {
    Ranges ranges;
    std::future<absl::Status> done;
    std::shared_ptr<dataplane::DataPlane::ReadHashes> hashes;
  };
  std::vector<Posted> posted;
  PullJob::Fetch from = request.fetch;
  from.node = request.relay;

  auto post_available = [&] {
    Ranges now = Intersect(pending, landed);
    if (now.empty()) return;
    pending = Subtract(pending, now);
    auto hashes = std::make_shared<dataplane::DataPlane::ReadHashes>();
    posted.push_back(
        {now, data_plane->Read(from, now, request.slot, request.landed, hashes), hashes});
  };

  v1::RelayProgress message;
  if (!stream->Read(&message)) {
    const grpc::Status status = stream->Finish();
    result.leftover = request.wanted;
    // Not pulling it (yet), or serving as many readers as it may: normal, not a failure.
    result.failed = status.error_code() != grpc::StatusCode::NOT_FOUND &&
                    status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED;
    result.why = status.error_message().empty() ? "no answer" : status.error_message();
    if (watchdog.Fired()) {
      result.failed = true;
      result.why = watchdog.Why();
    }
    return result;
  }
  if (message.bytes() != request.fetch.bytes || message.remote_key().empty()) {
    context.TryCancel();
    (void)stream->Finish();
    result.leftover = request.wanted;
    result.failed = true;
    result.why =
        absl::StrCat("it offered a ", message.bytes(), "-byte piece, not ", request.fetch.bytes);
    return result;
  }
  from.remote_key = message.remote_key();
  const Ranges planned = FromProto(message.planned(), request.fetch.bytes);
  pending = Intersect(request.wanted, planned);
  result.leftover = Subtract(request.wanted, planned);
  if (!result.leftover.empty()) result.why = "it holds only part of what this node needs";
  bool ended = false;
  watchdog.Heard(/*news=*/true);
  while (true) {
    Ranges fresh = FromProto(message.landed(), request.fetch.bytes);
    if (message.complete()) fresh = planned;
    if (!fresh.empty()) {
      const uint64_t before = Total(landed);
      landed.insert(landed.end(), fresh.begin(), fresh.end());
      Merge(&landed);
      watchdog.Heard(/*news=*/Total(landed) > before);
      post_available();
    } else {
      watchdog.Heard(/*news=*/false);
    }
    if (pending.empty()) break;
    if (!stream->Read(&message)) {
      ended = true;
      break;
    }
  }
  // The stream is only kept open now, for the reads still in flight from the relay's slot.
  watchdog.Stop();
  // Every read posted so far finishes (or fails) before the stream lets the relay's slot go.
  for (Posted& p : posted) {
    absl::Status status = p.done.get();
    if (status.ok()) {
      result.read.insert(result.read.end(), p.ranges.begin(), p.ranges.end());
      if (!p.hashes->empty()) result.hashes.insert((*p.hashes)[0].begin(), (*p.hashes)[0].end());
    } else {
      result.leftover.insert(result.leftover.end(), p.ranges.begin(), p.ranges.end());
      result.failed = true;
      result.why = status.ToString();
    }
  }
  context.TryCancel();
  const grpc::Status finished = stream->Finish();
  if (!pending.empty()) {
    result.leftover.insert(result.leftover.end(), pending.begin(), pending.end());
    result.failed = true;
    if (watchdog.Fired()) {
      result.why = watchdog.Why();
    } else if (result.why.empty() || result.why == "it holds only part of what this node needs") {
      result.why =
          ended ? absl::StrCat("its stream ended: ", finished.error_message()) : "it stopped short";
    }
  }
  Merge(&result.read);
  Merge(&result.leftover);
  result.bytes = Total(result.read);
  return result;
}

}  // namespace refit::pull
