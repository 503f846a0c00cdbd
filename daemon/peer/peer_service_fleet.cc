// PeerService's fleet calls: Relay (serving a piece this node is pulling too) and Report (a
// replica's report, answered with its relay candidates). peer_service.cc has the rest.

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/peer/peer_service.h"
#include "daemon/pull/relay_read.h"
#include "daemon/rl/timeline.h"

namespace refit::peer {

namespace {
// A RelayRequest's wanted ranges past this many are not recorded (a hint; one per 4 MiB chunk
// of a 256 GiB piece).
constexpr int kMaxWantedRanges = 65536;
// How long a Relay call waits for this node to start pulling the piece it asks for (the
// announcement reaches every node at about the same time), and the longest quiet gap in its
// stream.
constexpr auto kRelayStartWait = std::chrono::milliseconds(2000);
constexpr auto kRelayHeartbeat = std::chrono::milliseconds(500);
constexpr auto kRelayLongest = std::chrono::minutes(30);
// Once complete was sent, how often the stream looks whether its reader went.
constexpr auto kRelayCompletePoll = std::chrono::milliseconds(20);
constexpr size_t kMaxName = 1024;
// A replica report: what one node may say (its models, and their names' bytes in all).
constexpr int kMaxReportModels = 4096;
constexpr size_t kMaxReportNameBytes = 256 << 10;

// The ranges a RelayRequest says it wants, sorted and merged; empty when it says none (an
// older reader) or more than kMaxWantedRanges: then it is told of everything that lands.
fleet::Ranges WantedRanges(const v1::RelayRequest& request) {
  fleet::Ranges wanted;
  if (request.wanted_size() > kMaxWantedRanges) return wanted;
  for (const v1::ByteRange& r : request.wanted()) {
    if (r.length() == 0 || r.offset() + r.length() < r.offset()) continue;
    wanted.emplace_back(r.offset(), r.offset() + r.length());
  }
  pull::Merge(&wanted);
  return wanted;
}

// What of `landed` (ranges in the order they landed) a reader that wants `wanted` (sorted,
// disjoint; empty: everything) is told of. Every node relaying a piece lands all of it, most
// from other relays; without this each of its readers would hear of (and wake for) every read
// this node makes, not only of the stripes it reads here.
fleet::Ranges ForReader(fleet::Ranges landed, const fleet::Ranges& wanted) {
  pull::Merge(&landed);
  if (wanted.empty()) return landed;
  return pull::Intersect(landed, wanted);
}

void AddRanges(const fleet::Ranges& ranges,
               google::protobuf::RepeatedPtrField<v1::ByteRange>* out) {
  for (const auto& [begin, end] : ranges) {
    v1::ByteRange* r = out->Add();
    r->set_offset(begin);
    r->set_length(end - begin);
  }
}
}  // namespace

// A node's place among the nodes reading relayed stripes here: taken by Relay (or refused past
// --max-peer-connections readers), given back when its stream ends.
class PeerService::RelayReaderSlot {
 public:
  RelayReaderSlot(PeerService* service, std::string node)
      : service_(service), node_(std::move(node)) {}
  ~RelayReaderSlot() {
    if (!taken_) return;
    common::MutexLock lock(service_->mu_);
    auto it = service_->relay_readers_.find(node_);
    if (it != service_->relay_readers_.end() && --it->second <= 0) {
      service_->relay_readers_.erase(it);
      service_->metrics_->Add(kRelayReaders, -1);
    }
  }
  RelayReaderSlot(const RelayReaderSlot&) = delete;
  RelayReaderSlot& operator=(const RelayReaderSlot&) = delete;

  // False when other nodes fill every place.
  bool Take() {
    common::MutexLock lock(service_->mu_);
    auto it = service_->relay_readers_.find(node_);
    if (it == service_->relay_readers_.end()) {
      if (service_->relay_readers_.size() >= service_->max_relay_readers_) return false;
      it = service_->relay_readers_.emplace(node_, 0).first;
      service_->metrics_->Add(kRelayReaders, 1);
    }
    ++it->second;
    taken_ = true;
    return true;
  }

 private:
  PeerService* const service_;
  const std::string node_;
  bool taken_ = false;
};

void PeerService::NoteEntry(const fleet::RelayKey& key, const v1::RelayRequest& request) {
  std::string site;
  {
    common::MutexLock lock(mu_);
    site = site_;
  }
  // Only readers of another site enter theirs here; an older reader says no ranges.
  if (request.site() == site || request.wanted_size() == 0 ||
      request.wanted_size() > kMaxWantedRanges || request.site().size() > kMaxNodeName) {
    return;
  }
  const fleet::Ranges merged = WantedRanges(request);
  const fleet::EntryClaims::Conflict conflict =
      entry_claims_.Claim(key, request.site(), request.node(), merged);
  if (conflict.other.empty()) return;
  metrics_->Add(kSiteEntryConflicts, 1);
  if (!conflict.first) return;
  Logger("peer")->warn(
      "model={} version={}: nodes {} and {} of site '{}' both read {} bytes of piece {} of node "
      "{} across sites from this node: two entries into site '{}' (each version should cross "
      "into a site once); their views of site '{}' differ: check node {}'s --site and that the "
      "nodes of site '{}' reach each other",
      Printable(key.model), key.version, Printable(request.node()), Printable(conflict.other),
      Printable(request.site()), conflict.bytes, Printable(key.buffer_id), Printable(key.origin),
      Printable(request.site()), Printable(request.site()), Printable(request.node()),
      Printable(request.site()));
}

grpc::Status PeerService::Relay(grpc::ServerContext* context, const v1::RelayRequest* request,
                                grpc::ServerWriter<v1::RelayProgress>* writer) {
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  if (!relay_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", node_, " does not relay (--relay=false)"));
  }
  if (request->model().empty() || request->model().size() > kMaxName ||
      request->origin().size() > kMaxNodeName || request->buffer_id().size() > kMaxName ||
      !CheckNodeName(request->node()).ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "malformed relay request");
  }
  auto ticket = streams_.Admit(SourceOf(*context, request->node()), "Relay");
  if (!ticket.ok()) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        std::string(ticket.status().message()));
  }
  // Incoming relay readers are capped like outgoing relay channels: past the cap a node reads
  // these stripes from the origin.
  RelayReaderSlot reader(this, request->node());
  if (!reader.Take()) {
    metrics_->Add(kRelayReadersRefused, 1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("node ", node_, " serves relayed stripes to at most ",
                                     "--max-peer-connections other nodes at once"));
  }
  const fleet::RelayKey key{request->model(), request->version(), request->origin(),
                            request->buffer_id()};
  const auto start = std::chrono::steady_clock::now();
  auto view = board_->Wait(key, 0, start + kRelayStartWait);
  if (!view.ok() || view->state == fleet::RelayState::kFailed) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("node ", node_, " is not pulling piece ", request->buffer_id(),
                                     " of model ", request->model(), " version ",
                                     request->version(), " from ", request->origin()));
  }
  NoteEntry(key, *request);
  const std::shared_ptr<Region> slot = view->slot;  // held while the stream lasts
  // The reader's grant to read the relayed slot lasts as long as this stream.
  auto remote_key = data_plane_->Expose(slot, request->node());
  if (!remote_key.ok()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(remote_key.status().message()));
  }
  Logger("peer")->debug("model={} version={} relaying piece {} of node {} to node {}",
                        Printable(request->model()), request->version(),
                        Printable(request->buffer_id()), Printable(request->origin()),
                        Printable(request->node()));
  if (rl_.timeline) {
    rl_.timeline->Mark(request->model(), request->version(), rl::kStageRelayed,
                       absl::StrCat("to ", request->node(), " (piece ", request->buffer_id(),
                                    " of ", request->origin(), ")"));
  }
  const fleet::Ranges wanted = WantedRanges(*request);
  v1::RelayProgress progress;
  progress.set_remote_key(remote_key->descriptor);
  progress.set_bytes(view->bytes);
  AddRanges(view->planned, progress.mutable_planned());
  bool complete = false;
  bool first = true;
  size_t cursor = 0;
  auto written = std::chrono::steady_clock::now();
  while (true) {
    if (view->state == fleet::RelayState::kFailed) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("node ", node_, "'s own pull of that version failed"));
    }
    const fleet::Ranges news = ForReader(view->landed, wanted);
    for (const auto& [begin, end] : news) {
      if (relay_flips_.load() > 0 && relay_flips_.fetch_sub(1) > 0 && end > begin) {
        slot->data()[begin] +=
            1;  // a relay serving wrong bytes (tests only; adds up, never undoes)
      }
    }
    const bool now_complete = complete || view->state == fleet::RelayState::kComplete;
    cursor = view->cursor;
    // Written: the first message, news for this reader, completion, and a heartbeat at least
    // every kRelayHeartbeat; landings of stripes this reader reads elsewhere are not.
    if (first || !news.empty() || now_complete != complete ||
        std::chrono::steady_clock::now() - written >= kRelayHeartbeat) {
      AddRanges(news, progress.mutable_landed());
      progress.set_complete(now_complete);
      if (!writer->Write(progress)) return grpc::Status::OK;
      written = std::chrono::steady_clock::now();
      progress.Clear();
      first = false;
    }
    complete = now_complete;
    if (context->IsCancelled()) return grpc::Status::CANCELLED;
    {
      common::MutexLock lock(mu_);
      if (stopped_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is stopping");
    }
    if ((*ticket)->evicted()) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "too many peer streams here: this one gave its place to another peer's");
    }
    if (std::chrono::steady_clock::now() - start > kRelayLongest) return grpc::Status::OK;
    if (complete) {
      // Nothing more will land: the stream now only keeps the slot while the reader finishes
      // its reads, with a heartbeat. (Wait returns at once once a pull is no longer in
      // progress: asking it again here would send an empty message per turn for as long as the
      // reader reads, a flood of control traffic on its link, and a core spinning.)
      const auto beat = std::chrono::steady_clock::now() + kRelayHeartbeat;
      while (std::chrono::steady_clock::now() < beat && !context->IsCancelled()) {
        std::this_thread::sleep_for(kRelayCompletePoll);
      }
      if (context->IsCancelled()) return grpc::Status::CANCELLED;
      view = fleet::RelayView{};
      view->state = fleet::RelayState::kComplete;
      view->cursor = cursor;
      continue;
    }
    view = board_->Wait(key, cursor, written + kRelayHeartbeat);
    if (!view.ok()) {
      // Its entry went: a newer version's pull began here. Once complete was sent the reader
      // only finishes its reads, from the slot this stream still holds.
      if (!complete) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this node moved on to a newer version");
      }
      std::this_thread::sleep_for(kRelayHeartbeat);
      view = fleet::RelayView{};
      view->state = fleet::RelayState::kComplete;
      view->cursor = cursor;
    }
  }
}

grpc::Status PeerService::Report(grpc::ServerContext* context, const v1::ReplicaReport* request,
                                 v1::ReplicaReportResponse* response) {
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  NoteLargeRequest(request->ByteSizeLong());
  if (!replicas_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no replica table");
  if (absl::Status name = CheckNodeName(request->node()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (request->node() == node_) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "a replica report names its own node, not this one");
  }
  if (request->site().size() > kMaxNodeName) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("a site name is at most ", kMaxNodeName, " bytes (got ",
                                     request->site().size(), ")"));
  }
  if (request->models_size() > kMaxReportModels) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("a replica report names at most ", kMaxReportModels, " models"));
  }
  // Only a node subscribed here (with TLS: authenticated) counts as a replica: a report from a
  // node this daemon doesn't know changes nothing (WaitForReplicas waits for real nodes).
  {
    common::MutexLock lock(mu_);
    auto sub = subscribers_.lower_bound({request->node(), ""});
    if (sub == subscribers_.end() || sub->first != request->node()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("node ", Printable(request->node()),
                                       " is not subscribed here: a replica report comes from a "
                                       "node that pulls from this one (Subscribe first)"));
    }
  }
  std::vector<fleet::ReplicaEntry> entries;
  size_t name_bytes = 0;
  for (const auto& m : request->models()) {
    if (m.model().empty() || m.model().size() > kMaxName) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a model name is 1 to 1024 bytes");
    }
    name_bytes += m.model().size();
    if (name_bytes > kMaxReportNameBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("a replica report's model names take at most ",
                                       kMaxReportNameBytes, " bytes"));
    }
    // A version of a model published here that this node never published is a lie or a
    // confusion (another run under the same name): refused, and nothing changes.
    const uint64_t published = store_->LatestLocalSnapshot(m.model());
    if (published > 0 && m.latest_version() > published) {
      const std::string why = absl::StrCat("node ", Printable(request->node()), " reports version ",
                                           m.latest_version(), " of model ", Printable(m.model()),
                                           ", but the newest published here is ", published);
      {
        common::MutexLock lock(mu_);
        if (refused_reports_.size() >= 64) refused_reports_.clear();  // logged once, bounded
        if (refused_reports_.insert(request->node()).second) {
          Logger("peer")->warn("replica report refused: {}", why);
        }
      }
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
    }
    entries.push_back({m.model(), m.latest_version(), m.rollback_version(), m.rolled_back()});
  }
  // Who else pulls these models, and where to reach them: the reporter's relay candidates,
  // so that it needn't be connected to every node (bounded peer connections).
  std::map<std::string, v1::FleetMember> members;
  for (const fleet::ReplicaEntry& entry : entries) {
    for (const fleet::Replica& replica : replicas_->ReplicasOf(entry.model)) {
      if (replica.node == request->node()) continue;
      v1::FleetMember& member = members[replica.node];
      member.set_node(replica.node);
      member.set_relay(replica.relay);
      member.set_site(replica.site);
      v1::ReplicaReport::Model* m = member.add_models();
      m->set_model(entry.model);
      m->set_latest_version(replica.latest_version);
      m->set_rollback_version(replica.rollback_version);
      m->set_rolled_back(replica.rolled_back);
    }
  }
  if (absl::Status kept =
          replicas_->Report(request->node(), request->relay(), std::move(entries), request->site());
      !kept.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(kept.code()), std::string(kept.message()));
  }
  constexpr int kMaxMembers = 4096;
  common::MutexLock lock(mu_);
  for (auto& [node, member] : members) {
    auto dial = dial_.find(node);
    if (dial == dial_.end()) continue;  // not subscribed here: nowhere to send the reporter
    if (response->members_size() >= kMaxMembers) break;
    member.set_listen(dial->second);
    *response->add_members() = std::move(member);
  }
  return grpc::Status::OK;
}

}  // namespace refit::peer
