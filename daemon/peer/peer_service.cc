#include "daemon/peer/peer_service.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"
#include "daemon/convert/convert.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"
#include "daemon/tls/peer_tls.h"
#include "daemon/version.h"

namespace refit::peer {

PeerService::PeerService(std::string node, PeerStore* store, DataPlane* data_plane,
                         DeltaSource* deltas, Metrics* metrics, fleet::RelayBoard* board,
                         fleet::ReplicaTable* replicas, PeerServiceOptions options)
    : node_(std::move(node)),
      store_(store),
      data_plane_(data_plane),
      deltas_(deltas),
      metrics_(metrics),
      board_(board),
      replicas_(replicas),
      relay_(options.relay && board != nullptr),
      tls_(options.tls),
      max_relay_readers_(std::max<uint32_t>(1, options.max_relay_readers)) {
  metrics_->Declare(kDataBytesSent);
  metrics_->Declare(kRelayBytesSent);
  metrics_->Declare(kChecksumBytesHashed);
  metrics_->Declare(kRelayReaders);
  metrics_->Declare(kRelayReadersRefused);
  metrics_->Declare(kSiteEntryConflicts);
  if (const char* fault = TestSwitch("REFIT_FAULT_RELAY_FLIP")) {
    relay_flips_ = std::atoll(fault);
    Logger("peer")->warn("fault injection: the first {} relayed ranges get a flipped byte",
                         relay_flips_.load());
  }
  if (const char* fault = TestSwitch("REFIT_FAULT_CORRUPT_CHECKSUMS")) {
    corrupt_checksums_ = std::atoll(fault);
    Logger("peer")->warn("fault injection: the first {} checksum replies will be wrong",
                         corrupt_checksums_.load());
  }
  if (const char* fault = TestSwitch("REFIT_FAULT_CHECKSUM_WITHOUT_RUNS");
      fault != nullptr && std::string(fault) != "" && std::string(fault) != "0") {
    checksum_without_runs_ = true;
    Logger("peer")->warn("fault injection: Checksum reads plain ranges only (an older release)");
  }
}

void PeerService::NotifyChanged() {
  {
    common::MutexLock lock(mu_);
    generation_++;
  }
  changed_.NotifyAll();
}

void PeerService::OnLocalVersionReady(const std::string& /*model*/, uint64_t /*version*/) {
  NotifyChanged();
}

void PeerService::OnLayoutChanged(const std::string& /*model*/) { NotifyChanged(); }

void PeerService::OnRunStarted(const std::string& /*model*/, const std::string& /*run*/) {
  NotifyChanged();
}

void PeerService::OnHoldChanged(const std::string& /*model*/, uint64_t /*version*/) {
  NotifyChanged();
}

void PeerService::Stop() {
  {
    common::MutexLock lock(mu_);
    stopped_ = true;
    // Pins stay until the service is destroyed, after the data plane: peers' reads in flight
    // must not find their memory gone.
  }
  changed_.NotifyAll();
}

namespace {

// `listen` ("host:port") with an unspecified host (0.0.0.0, [::], none) replaced by the host of
// `peer` (grpc's "ipv4:10.0.0.2:41234" / "ipv6:[fd00::2]:41234").
std::string DialAddress(const std::string& listen, const std::string& peer) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos) return listen;
  const std::string host = listen.substr(0, colon);
  if (host != "0.0.0.0" && host != "[::]" && host != "::" && !host.empty()) return listen;
  const auto scheme = peer.find(':');
  const auto port = peer.rfind(':');
  if (scheme == std::string::npos || port <= scheme) return listen;
  return peer.substr(scheme + 1, port - scheme - 1) + listen.substr(colon);
}

}  // namespace

absl::Status PeerService::Authenticate(const grpc::ServerContext& context,
                                       const std::string& node) const {
  if (!tls_) return absl::OkStatus();
  auto auth = context.auth_context();
  if (!auth) return absl::PermissionDeniedError("no TLS identity");
  return tls::CheckIdentity(*auth, node);
}

std::string PeerService::SourceOf(const grpc::ServerContext& context,
                                  const std::string& node) const {
  // With TLS the node name was authenticated (Authenticate); without, only the host is known.
  return tls_ ? absl::StrCat("node ", node) : absl::StrCat("host ", PeerHost(context.peer()));
}

void PeerService::SetIdentity(const std::string& instance, const std::string& listen) {
  common::MutexLock lock(mu_);
  instance_ = instance;
  listen_ = listen;
}

void PeerService::SetSite(const std::string& site) {
  common::MutexLock lock(mu_);
  site_ = site;
}

std::vector<PeerService::Subscriber> PeerService::Subscribers() const {
  common::MutexLock lock(mu_);
  std::vector<Subscriber> out;
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& entry : subscribers_) {
    if (seen.insert(entry).second) {
      out.push_back({Printable(entry.first, kMaxNodeName), Printable(entry.second), true, ""});
    }
  }
  for (const auto& [address, error] : refused_) {
    out.push_back({node_, address, false, error});
  }
  return out;
}

grpc::Status PeerService::Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                                v1::HelloResponse* response) {
  NoteLargeRequest(request->ByteSizeLong());
  Logger("peer")->debug("peer={} hello (refitd {}) from {}", Printable(request->node()),
                        Printable(request->version()), context->peer());
  if (absl::Status name = CheckNodeName(request->node()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (request->listen().size() > kMaxListen) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("a --listen address is at most ", kMaxListen, " bytes"));
  }
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  std::string instance, listen, site;
  {
    common::MutexLock lock(mu_);
    instance = instance_;
    listen = listen_;
    site = site_;
  }
  // Node names tell pieces apart: another daemon with this node's name is refused (a caller
  // with this instance id is this daemon itself, through a name that resolves to every daemon).
  // What the caller says (its --listen) is shown escaped and short, next to where it called from:
  // a Hello is no way to put a peer's text into this daemon's Status.
  if (request->node() == node_ && !request->instance().empty() && request->instance() != instance) {
    const std::string caller = context->peer();
    const std::string error =
        absl::StrCat("two daemons have --node=", node_, ": the one at ", caller,
                     request->listen().empty()
                         ? ""
                         : absl::StrCat(" (listening on ", Printable(request->listen(), 64), ")"),
                     " and this one at ", listen,
                     "; node names must be unique: give each refitd its own --node");
    bool first = false;
    {
      common::MutexLock lock(mu_);
      first = refused_.emplace(caller, error).second;
      if (refused_.size() > 16) refused_.erase(refused_.begin());
    }
    if (first) Logger("peer")->warn("peer at {} refused: {}", caller, error);
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
  }
  response->set_instance(instance);
  response->set_listen(listen);
  response->set_site(site);
  response->set_node(node_);
  response->set_version(kRefitVersion);
  response->set_transport_address(data_plane_->LocalAddress());
  response->set_transport(data_plane_->TransportName());
  return grpc::Status::OK;
}

bool PeerService::BuildEvent(const std::string& model, const std::vector<SourceLayout>& layouts,
                             bool with_sources, const std::string& node, v1::PeerEvent* event) {
  event->set_model(model);
  event->set_sources_unchanged(!with_sources);
  for (const SourceLayout& layout : with_sources ? layouts : std::vector<SourceLayout>()) {
    v1::SourcePiece* piece = event->add_sources();
    piece->set_buffer_id(layout.buffer_id);
    piece->set_bytes(layout.bytes);
    for (const TensorSlice& s : *layout.slices) convert::ToProto(s, piece->add_tensors());
  }
  const uint64_t version = deltas_ ? deltas_->Prepared(model) : store_->LatestLocalSnapshot(model);
  if (version == 0) return true;
  auto snapshot = Snapshot(model, version);
  if (!snapshot) return true;
  event->set_trainer_run(snapshot->run);
  for (const LocalSnapshot::Piece& p : snapshot->pieces) {
    // The reader's own key; it may read once it pins the version (Pin grants it).
    auto key = data_plane_->Expose(p.slot, node);
    if (!key.ok()) {
      Logger("peer")->error("model={} version={} cannot expose {}: {}", model, version, p.buffer_id,
                            key.status().ToString());
      return true;  // announce the layout only
    }
    v1::VersionPiece* piece = event->add_pieces();
    piece->set_buffer_id(p.buffer_id);
    piece->set_remote_key(key->descriptor);
    piece->set_bytes(p.slot->size());
  }
  if (deltas_) {
    for (const EncodedDelta& d : deltas_->Deltas(model)) {
      if (d.version > version) continue;
      auto key = data_plane_->Expose(d.bytes, node);
      if (!key.ok()) continue;  // receivers pull that step in full
      v1::DeltaPiece* piece = event->add_deltas();
      piece->set_buffer_id(d.buffer_id);
      piece->set_base_version(d.base_version);
      piece->set_version(d.version);
      piece->set_remote_key(key->descriptor);
      piece->set_bytes(d.bytes->size());
    }
  }
  event->set_version(version);
  if (rl_.labels) {
    for (const auto& [key, value] : rl_.labels->Get(model, version)) {
      (*event->mutable_labels())[key] = value;
    }
  }
  if (rl_.staleness) event->set_max_staleness(rl_.staleness->Of(model).max_staleness);
  return true;
}

grpc::Status PeerService::Subscribe(grpc::ServerContext* context,
                                    const v1::SubscribeRequest* request,
                                    grpc::ServerWriter<v1::PeerEvent>* writer) {
  NoteLargeRequest(request->ByteSizeLong());
  if (absl::Status name = CheckNodeName(request->node()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (request->listen().size() > kMaxListen) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("a --listen address is at most ", kMaxListen, " bytes"));
  }
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  auto ticket = streams_.Admit(SourceOf(*context, request->node()), "Subscribe");
  if (!ticket.ok()) {
    // Said once per 100 refusals: an attacker's streams don't become a flood of log lines.
    if (streams_.refusals() % 100 == 1) {
      Logger("peer")->warn("peer={} from {}: {} ({} refused so far)", Printable(request->node()),
                           context->peer(), std::string(ticket.status().message()),
                           streams_.refusals());
    }
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        std::string(ticket.status().message()));
  }
  Logger("peer")->info("peer={} subscribed from {}", Printable(request->node()), context->peer());
  const std::pair<std::string, std::string> me(
      request->node(), request->listen().empty() ? context->peer() : request->listen());
  {
    common::MutexLock lock(mu_);
    subscribers_.insert(me);
    if (!request->listen().empty())
      dial_[me.first] = DialAddress(request->listen(), context->peer());
  }
  struct Leave {
    PeerService* service;
    std::pair<std::string, std::string> me;
    ~Leave() {
      common::MutexLock lock(service->mu_);
      auto it = service->subscribers_.find(me);
      if (it != service->subscribers_.end()) service->subscribers_.erase(it);
      // Its dial address goes with its last subscription: no node name outlives its streams.
      auto other = service->subscribers_.lower_bound({me.first, ""});
      if (other == service->subscribers_.end() || other->first != me.first) {
        service->dial_.erase(me.first);
      }
    }
  } leave{this, me};
  std::map<std::string, std::string> sent;    // model -> what was last sent (serialized)
  std::map<std::string, uint64_t> announced;  // model -> the version last announced (timeline)
  // model -> the layouts last sent. The store keeps a buffer's slice vector (immutable) while
  // it stays registered; holding them here keeps their addresses from being reused, so equal
  // ids, sizes and vectors mean the same layout.
  std::map<std::string, std::vector<SourceLayout>> sent_layouts;
  auto same = [](const std::vector<SourceLayout>& a, const std::vector<SourceLayout>& b) {
    return std::equal(
        a.begin(), a.end(), b.begin(), b.end(), [](const SourceLayout& x, const SourceLayout& y) {
          return x.buffer_id == y.buffer_id && x.bytes == y.bytes && x.slices == y.slices;
        });
  };
  uint64_t seen = UINT64_MAX;
  while (true) {
    // Lapsed pins (a reader that died mid-pull) let go of their version's slots within a tick,
    // not only at the next Pin call; they are released here, outside the lock.
    std::vector<Pinned> lapsed;
    {
      common::UniqueLock lock(mu_);
      const bool changed = changed_.WaitFor(
          lock, std::chrono::milliseconds(200),
          [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ || generation_ != seen; });
      if (stopped_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is stopping");
      if ((*ticket)->evicted()) {
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            "too many peer streams here: this one gave its place to another peer's");
      }
      lapsed = ExpirePins();
      if (!changed) {
        lock.unlock();
        lapsed.clear();
        TrimAfterLargeRequests();
        if (context->IsCancelled()) return grpc::Status::CANCELLED;
        continue;
      }
      seen = generation_;
    }
    if (context->IsCancelled()) return grpc::Status::CANCELLED;
    auto layouts = store_->LocalSourceLayouts();
    for (const auto& [model, text] : sent) {
      if (!layouts.count(model)) layouts[model] = {};  // all its sources went away
    }
    for (const auto& [model, model_layouts] : layouts) {
      auto layouts_sent = sent_layouts.find(model);
      const bool with_sources =
          layouts_sent == sent_layouts.end() || !same(layouts_sent->second, model_layouts);
      v1::PeerEvent event;
      BuildEvent(model, model_layouts, with_sources, request->node(), &event);
      event.set_rollback_version(store_->HoldOf(model));
      {
        common::MutexLock lock(mu_);
        event.set_run(instance_);
      }
      // Remote keys are stable per slot, so equal text means nothing new.
      std::string text = event.SerializeAsString();
      if (sent[model] == text) continue;
      if (!writer->Write(event)) return grpc::Status::OK;
      if (rl_.timeline && event.version() > 0 && announced[model] != event.version()) {
        announced[model] = event.version();
        rl_.timeline->Mark(model, event.version(), rl::kStageAnnounced,
                           absl::StrCat("to ", Printable(request->node())));
      }
      sent_layouts[model] = model_layouts;
      sent[model] = std::move(text);
      Logger("peer")->debug("peer={} told model={} sources={} version={}",
                            Printable(request->node()), model, event.sources_size(),
                            event.version());
    }
  }
}

namespace {
// Ranges one Checksum call may ask about: what a reader asks for at most (2^18: a 2 MiB
// reply).
constexpr size_t kMaxChecksumRanges = 1u << 18;
}  // namespace

grpc::Status PeerService::Checksum(grpc::ServerContext* context, const v1::ChecksumRequest* request,
                                   v1::ChecksumResponse* response) {
  // Digests are served inside a grant only: to a reader that pins this version here, about a
  // piece its pin lets it read anyway, proven by the remote key this daemon sent that node
  // (its data-plane token) and, with TLS, by its certificate. Nobody else learns anything of
  // the bytes: not even whether the version is held.
  if (request->node().empty() || request->node().size() > kMaxNodeName) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("a checksum request names its reader (node: 1 to ", kMaxNodeName, " bytes)"));
  }
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  std::shared_ptr<const LocalSnapshot> snapshot;
  std::string granted_key;
  std::vector<Pinned> lapsed;  // released after the lock
  {
    common::MutexLock lock(mu_);
    lapsed = ExpirePins();
    auto pin = pins_.find(std::make_tuple(request->model(), request->version(), request->node()));
    if (pin != pins_.end()) {
      snapshot = pin->second.snapshot;
      auto key = pin->second.keys.find(request->buffer_id());
      if (key != pin->second.keys.end()) granted_key = key->second;
    }
  }
  if (!snapshot) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat("node ", Printable(request->node()), " holds no pin of model ",
                     Printable(request->model()), " version ", request->version(),
                     " here: checksums are answered only to a reader that pins the version"));
  }
  if (granted_key.empty() || !SameBytes(granted_key, request->remote_key())) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("no piece ", Printable(request->buffer_id()),
                                     " granted to node ", Printable(request->node()),
                                     " under that remote key in version ", request->version()));
  }
  const LocalSnapshot::Piece* piece = nullptr;
  for (const auto& p : snapshot->pieces) {
    if (p.buffer_id == request->buffer_id()) piece = &p;
  }
  if (!piece) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no piece ", Printable(request->buffer_id()), " in version ",
                                     request->version()));
  }
  const uint64_t size = piece->slot->size();
  // Every range asked for, checked before anything is read. A reader asks about what it read:
  // ranges that don't overlap within a run, and no more bytes than the piece holds, so one call
  // costs at most one pass over the piece.
  auto refuse = [](const std::string& why) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
  };
  const std::string too_many = absl::StrCat("more than ", kMaxChecksumRanges,
                                            " ranges, or more bytes than the piece, in one call");
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t bytes = 0;
  for (const v1::ByteRange& r : request->ranges()) {
    if (r.offset() > size || r.length() > size - r.offset()) {
      return refuse("range past the piece's end");
    }
    if (ranges.size() >= kMaxChecksumRanges || r.length() > size - bytes) return refuse(too_many);
    bytes += r.length();
    ranges.emplace_back(r.offset(), r.offset() + r.length());
  }
  for (const v1::RangeRun& run : request->runs()) {
    if (checksum_without_runs_) break;  // unknown to an older release
    if (run.count() == 0) continue;
    if (run.count() > kMaxChecksumRanges - ranges.size()) return refuse(too_many);
    const uint64_t steps = run.count() - 1;
    if (steps > 0 && run.stride() < run.length()) {
      return refuse("a run's ranges overlap (stride < length)");
    }
    if (run.offset() > size || (steps > 0 && run.stride() > (size - run.offset()) / steps)) {
      return refuse("range past the piece's end");
    }
    const uint64_t last = run.offset() + steps * run.stride();
    if (run.length() > size - last) return refuse("range past the piece's end");
    // No overflow: count * length <= span of the run <= size.
    if (run.count() * run.length() > size - bytes) return refuse(too_many);
    bytes += run.count() * run.length();
    AppendRanges({run.offset(), run.length(), run.stride(), run.count()}, &ranges);
  }
  std::vector<uint64_t> sums(ranges.size());
  std::vector<std::pair<uint64_t, uint64_t>> off_grid;  // all of them, for the next Publishes
  std::vector<std::pair<uint64_t, uint64_t>> to_hash;   // those no Publish-time table holds
  std::vector<size_t> hashed_at;
  uint64_t hashed_bytes = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto [begin, end] = ranges[i];
    // A whole chunk of the grid was hashed at Publish (a full pull asks for exactly those);
    // so were ranges off it that peers asked for before (a resharded pull's, one per row).
    const uint64_t chunk = begin / kChecksumChunkBytes;
    if (piece->xxh3 && begin % kChecksumChunkBytes == 0 && chunk < piece->xxh3->size() &&
        end - begin == std::min(kChecksumChunkBytes, size - begin) && end > begin) {
      sums[i] = (*piece->xxh3)[chunk];
      continue;
    }
    off_grid.emplace_back(begin, end);
    if (!piece->range_xxh3 || !piece->range_xxh3->Find(begin, end - begin, &sums[i])) {
      hashed_at.push_back(i);
      to_hash.emplace_back(begin, end);
      hashed_bytes += end - begin;
    }
  }
  const std::vector<uint64_t> hashed = HashRanges(piece->slot->data(), to_hash);
  for (size_t k = 0; k < hashed.size(); ++k) sums[hashed_at[k]] = hashed[k];
  if (!off_grid.empty()) store_->NoteChecksumRanges(piece->buffer_id, size, ToRuns(off_grid));
  metrics_->Add(kChecksumBytesHashed, static_cast<double>(hashed_bytes));
  if (corrupt_checksums_.load() > 0 && corrupt_checksums_.fetch_sub(1) > 0 && !sums.empty()) {
    sums[0] ^= 1;
  }
  // Older peers ask with `ranges` and read `xxh3`.
  if (request->runs_size() == 0 || checksum_without_runs_) {
    response->mutable_xxh3()->Add(sums.begin(), sums.end());
  } else {
    response->mutable_sums()->Add(sums.begin(), sums.end());
  }
  return grpc::Status::OK;
}

std::vector<PeerService::Pinned> PeerService::ExpirePins() {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Pinned> lapsed;
  for (auto it = pins_.begin(); it != pins_.end();) {
    if (it->second.until < now) {
      Logger("peer")->info("model={} version={} pin of node {} lapsed (not renewed)",
                           Printable(std::get<0>(it->first)), std::get<1>(it->first),
                           Printable(std::get<2>(it->first)));
      lapsed.push_back(std::move(it->second));
      it = pins_.erase(it);
    } else {
      ++it;
    }
  }
  return lapsed;
}

std::shared_ptr<const LocalSnapshot> PeerService::Snapshot(const std::string& model,
                                                           uint64_t version) {
  // Each source is asked on its own, never under mu_: the store calls NotifyChanged (mu_)
  // with its own lock held.
  if (auto held = store_->GetLocalSnapshot(model, version); held.ok()) return *held;
  if (deltas_) {
    if (auto prepared = deltas_->PreparedSnapshot(model, version)) return prepared;
  }
  common::MutexLock lock(mu_);
  for (const auto& [key, pinned] : pins_) {
    if (std::get<0>(key) == model && std::get<1>(key) == version) return pinned.snapshot;
  }
  return nullptr;
}

namespace {
// A reader pins one version per model it pulls; these bound what a peer can hold alive here.
constexpr size_t kMaxPinsPerSource = 256;
constexpr size_t kMaxVersionsPerSource = 2;
constexpr uint32_t kMaxLeaseMs = 300000;
}  // namespace

grpc::Status PeerService::Pin(grpc::ServerContext* context, const v1::PinRequest* request,
                              v1::PinResponse*) {
  if (absl::Status name = CheckNodeName(request->node()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (absl::Status name = CheckModelName(request->model()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  const auto key = std::make_tuple(request->model(), request->version(), request->node());
  std::vector<Pinned> lapsed;  // released after the lock
  if (request->relay()) {
    // A reader done with what it read from this node's relayed copy (Relay): that copy is held
    // by the relay stream, not by a pin; only the bytes are counted.
    if (request->release()) {
      metrics_->Add(kDataBytesSent, static_cast<double>(request->bytes_read()));
      metrics_->Add(kRelayBytesSent, static_cast<double>(request->bytes_read()));
    }
    return grpc::Status::OK;
  }
  if (request->release()) {
    common::MutexLock lock(mu_);
    lapsed = ExpirePins();
    pins_.erase(key);
    metrics_->Add(kDataBytesSent, static_cast<double>(request->bytes_read()));
    return grpc::Status::OK;
  }
  auto snapshot = Snapshot(request->model(), request->version());
  if (!snapshot) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("model ", Printable(request->model()), ": version ",
                                     request->version(), " is not held here"));
  }
  std::vector<EncodedDelta> deltas;
  if (deltas_) deltas = deltas_->Deltas(request->model());
  // The reader may read these slots over the data plane while the pin lasts, and only then.
  // (A slot that can't be granted was never announced with a key: nobody reads it.)
  std::vector<std::shared_ptr<void>> grants;
  std::map<std::string, std::string> keys;  // piece -> its descriptor for this reader
  for (const LocalSnapshot::Piece& p : snapshot->pieces) {
    auto exposed = data_plane_->Expose(p.slot, request->node());
    if (!exposed.ok()) continue;
    grants.push_back(std::move(exposed->grant));
    keys[p.buffer_id] = std::move(exposed->descriptor);
  }
  for (const EncodedDelta& d : deltas) {
    auto exposed = data_plane_->Expose(d.bytes, request->node());
    if (exposed.ok()) grants.push_back(std::move(exposed->grant));
  }
  const uint32_t lease_ms = std::clamp<uint32_t>(request->lease_ms(), 1000, kMaxLeaseMs);
  common::MutexLock lock(mu_);
  lapsed = ExpirePins();
  // What one peer may keep alive here. A reader pulls one version of a model at a time: its pin
  // of another version of that model goes (it moved on). One source (host, or certificate)
  // keeps at most kMaxVersionsPerSource versions of a model pinned, the newest ones (a pin of a
  // newer version lets its oldest go), and kMaxPinsPerSource pins in all: what pins hold past
  // --retain is bounded in bytes by a few versions of each model per source, whatever names it
  // claims.
  const std::string source = SourceOf(*context, request->node());
  std::set<uint64_t> versions;  // of this model, pinned by this source (this pin's included)
  size_t held = 0;
  auto replaced = [&](const std::tuple<std::string, uint64_t, std::string>& k) {
    return std::get<0>(k) == request->model() && std::get<2>(k) == request->node() && k != key;
  };
  for (const auto& [k, pinned] : pins_) {
    if (pinned.source != source || k == key || replaced(k)) continue;
    ++held;
    if (std::get<0>(k) == request->model()) versions.insert(std::get<1>(k));
  }
  if (held >= kMaxPinsPerSource) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(Printable(source), " holds ", held,
                                     " pins here already (at most ", kMaxPinsPerSource, ")"));
  }
  if (versions.size() >= kMaxVersionsPerSource && !versions.count(request->version()) &&
      request->version() < *versions.begin()) {
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(Printable(source), " pins ", kMaxVersionsPerSource,
                     " newer versions of model ", Printable(request->model()), " here already"));
  }
  // Accepted: the reader's pin of another version of this model goes (it moved on) ...
  for (auto it = pins_.begin(); it != pins_.end();) {
    if (replaced(it->first)) {
      lapsed.push_back(std::move(it->second));
      it = pins_.erase(it);
    } else {
      ++it;
    }
  }
  // ... and so do the source's pins of its oldest versions of it, past kMaxVersionsPerSource.
  versions.insert(request->version());
  while (versions.size() > kMaxVersionsPerSource) {
    const uint64_t oldest = *versions.begin();
    versions.erase(versions.begin());
    for (auto it = pins_.begin(); it != pins_.end();) {
      if (std::get<0>(it->first) == request->model() && std::get<1>(it->first) == oldest &&
          it->second.source == source) {
        Logger("peer")->info("model={} version={} pin of node {} let go: {} pins newer versions",
                             Printable(request->model()), oldest, Printable(std::get<2>(it->first)),
                             Printable(source));
        lapsed.push_back(std::move(it->second));
        it = pins_.erase(it);
      } else {
        ++it;
      }
    }
  }
  Logger("peer")->debug("model={} version={} pinned by node {} for {} ms",
                        Printable(request->model()), request->version(), Printable(request->node()),
                        lease_ms);
  // A renewal replaces the pin: its new grants are in place before the old ones go.
  Pinned renewed{std::move(snapshot),
                 std::move(deltas),
                 std::chrono::steady_clock::now() + std::chrono::milliseconds(lease_ms),
                 std::move(grants),
                 std::move(keys),
                 source};
  std::swap(pins_[key], renewed);
  return grpc::Status::OK;
}

}  // namespace refit::peer
