#include "daemon/peer/peer_manager.h"

#include <netdb.h>
#include <sys/socket.h>
#include <arpa/inet.h>

#include <chrono>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/peer/delta_fetch.h"
#include "daemon/plan/plan.h"
#include "daemon/server/convert.h"
#include "daemon/version.h"
#include "grpcpp/grpcpp.h"

namespace refit::peer {
namespace {

using std::chrono::milliseconds;

constexpr auto kHelloDeadline = milliseconds(2000);
constexpr auto kCallDeadline = milliseconds(10000);
constexpr auto kMaxBackoff = milliseconds(2000);
// A reader's pin on a source's version lapses after its lease unless renewed; a pull renews its
// pins every quarter lease. 2 minutes; tests shorten it with $REFIT_TEST_PIN_LEASE_MS (the
// source takes at least 1 s).
constexpr uint32_t kPinLeaseMs = 120000;

// A peer's SOURCE layouts, checked as this daemon checks its own clients' (daemons of one
// release send normalized, valid ones; anything else is a bug or not a refitd): every slice
// inside its piece's bytes, no two sharing a byte.
absl::Status PeerLayouts(const v1::PeerEvent& event, std::vector<SourceLayout>* layouts) {
  constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 44;  // 16 TiB: no GPU rank's buffer
  std::set<std::string> ids;
  for (const v1::SourcePiece& source : event.sources()) {
    if (!ids.insert(source.buffer_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " is described twice"));
    }
    if (source.bytes() > kMaxPieceBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " claims ", source.bytes(), " bytes"));
    }
    ASSIGN_OR_RETURN(std::vector<TensorSlice> slices, server::FromProto(source.tensors()));
    if (slices.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", source.buffer_id(), " has no tensors"));
    }
    absl::Status valid = plan::NormalizeAndValidateBuffer(slices, source.bytes());
    if (!valid.ok()) {
      return absl::Status(valid.code(), absl::StrCat("piece ", source.buffer_id(), " of ",
                                                     source.bytes(), " bytes: ", valid.message()));
    }
    layouts->push_back({source.buffer_id(),
                        std::make_shared<std::vector<TensorSlice>>(std::move(slices)),
                        source.bytes()});
  }
  return absl::OkStatus();
}

uint32_t PinLeaseMs() {
  if (const char* test = std::getenv("REFIT_TEST_PIN_LEASE_MS")) {
    if (const long ms = std::strtol(test, nullptr, 10); ms > 0) return static_cast<uint32_t>(ms);
  }
  return kPinLeaseMs;
}
// Per Checksum call: ranges (8 B each in the reply: 2 MiB, under gRPC's default 4 MiB message
// limit) and runs (up to ~40 B each in the request).
constexpr uint64_t kRangesPerChecksumCall = 1u << 18;
constexpr size_t kRunsPerChecksumCall = 1u << 16;
constexpr int kFetchTries = 3;

std::chrono::system_clock::time_point In(milliseconds d) {
  return std::chrono::system_clock::now() + d;
}


}  // namespace

std::vector<std::string> ResolvePeerAddress(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return {address};
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &result) != 0 || !result) {
    return {address};
  }
  std::set<std::string> out;
  for (addrinfo* a = result; a; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.insert(std::string(ip) + ":" + port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip,
                sizeof(ip));
      out.insert("[" + std::string(ip) + "]:" + port);
    }
  }
  freeaddrinfo(result);
  if (out.empty()) return {address};
  return {out.begin(), out.end()};
}

namespace {

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

}  // namespace

struct PeerManager::Peer {
  std::string address;
  std::string node;
  bool connected = false;  // guarded by PeerManager::mu_
  std::unique_ptr<v1::Peer::Stub> stub;  // set by its thread before `node`, under mu_
  std::shared_ptr<grpc::Channel> channel;
  grpc::ClientContext* stream = nullptr;  // the live Subscribe call, for Stop
  std::thread thread;
};

PeerManager::PeerManager(std::string node, std::vector<std::string> addresses, Store* store,
                         DataPlane* data_plane, Metrics* metrics, double delta_threshold)
    : node_(std::move(node)),
      store_(store),
      data_plane_(data_plane),
      metrics_(metrics),
      delta_threshold_(delta_threshold),
      configured_(std::move(addresses)),
      pin_lease_ms_(PinLeaseMs()) {}

PeerManager::~PeerManager() { Stop(); }

void PeerManager::AddPeer(const std::string& address) {
  for (const auto& peer : peers_) {
    if (peer->address == address) return;
  }
  auto peer = std::make_unique<Peer>();
  peer->address = address;
  Peer* p = peer.get();
  peers_.push_back(std::move(peer));
  p->thread = std::thread([this, p] { RunPeer(p); });
}

void PeerManager::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
    for (const std::string& configured : configured_) {
      for (const std::string& address : ResolvePeerAddress(configured)) AddPeer(address);
    }
  }
  pull_thread_ = std::thread([this] { RunPulls(); });
  resolver_thread_ = std::thread([this] { RunResolver(); });
}

void PeerManager::RunResolver() {
  // Names may resolve to more daemons later (a DaemonSet scaling up behind a headless Service).
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::seconds(10), [this] { return stop_; });
      if (stop_) return;
    }
    for (const std::string& configured : configured_) {
      auto addresses = ResolvePeerAddress(configured);
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const std::string& address : addresses) AddPeer(address);
    }
  }
}

void PeerManager::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& peer : peers_) {
      if (peer->stream) peer->stream->TryCancel();
      // Dropping the endpoint cancels a pull in flight, so the pull worker can finish.
      if (!peer->node.empty()) data_plane_->Disconnect(peer->node);
    }
  }
  wake_.notify_all();
  if (resolver_thread_.joinable()) resolver_thread_.join();
  for (auto& peer : peers_) {  // no longer grows: stop_ is set
    if (peer->thread.joinable()) peer->thread.join();
  }
  if (pull_thread_.joinable()) pull_thread_.join();
}

std::vector<PeerState> PeerManager::Peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerState> out;
  for (const auto& peer : peers_) {
    if (peer->node == node_ + " (self)") continue;
    out.push_back({peer->address, peer->node, peer->connected});
  }
  return out;
}

void PeerManager::RunPeer(Peer* peer) {
  auto backoff = milliseconds(100);
  bool reported_down = false;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    args.SetMaxReceiveMessageSize(64 << 20);
    auto channel = grpc::CreateCustomChannel(peer->address, grpc::InsecureChannelCredentials(),
                                             args);
    auto stub = v1::Peer::NewStub(channel);
    v1::HelloRequest hello;
    hello.set_node(node_);
    hello.set_version(kRefitVersion);
    v1::HelloResponse who;
    grpc::ClientContext hello_context;
    hello_context.set_deadline(In(kHelloDeadline));
    grpc::Status status = stub->Hello(&hello_context, hello, &who);
    if (status.ok() && (who.node().empty() || who.node().size() > 255)) {
      // Pieces without a node are this node's own: such a peer's versions would look complete
      // here without a byte pulled.
      status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("it names itself '", who.node().substr(0, 64),
                                         "' (a node name is 1 to 255 bytes)"));
    }
    if (status.ok() && who.node() == node_) {
      // A name that resolves to every daemon (a headless Service) includes this one.
      Logger("peer")->info("peer at {} is this node; not connecting to it", peer->address);
      std::lock_guard<std::mutex> lock(mu_);
      peer->node = node_ + " (self)";
      return;
    }
    if (status.ok()) {
      backoff = milliseconds(100);
      reported_down = false;
      const std::string node = who.node();
      if (!who.transport_address().empty()) data_plane_->Connect(node, who.transport_address());
      grpc::ClientContext context;
      context.set_deadline(In(milliseconds(24ll * 3600 * 1000)));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        peer->node = node;
        peer->connected = true;
        peer->channel = channel;
        peer->stub = std::move(stub);
        peer->stream = &context;
      }
      metrics_->Add(kPeersConnected, 1);
      Logger("peer")->info("peer={} connected at {} (refitd {}, data plane {})", node,
                           peer->address, who.version(), who.transport());
      v1::SubscribeRequest request;
      request.set_node(node_);
      auto reader = peer->stub->Subscribe(&context, request);
      v1::PeerEvent event;
      while (reader->Read(&event)) {
        // Layouts come when they change; an event without them keeps the last ones.
        if (!event.sources_unchanged()) {
          std::vector<SourceLayout> layouts;
          absl::Status valid = PeerLayouts(event, &layouts);
          if (!valid.ok()) {
            // Planned from, it could have this node copy outside a slot; taken as "no sources
            // there", it could let a version complete without that node's shards. The peer is
            // dropped as if it had failed (its layout so far stays, and its versions are
            // forgotten), and reconnected with backoff.
            Logger("peer")->error("peer={} model={}: layout refused, disconnecting: {}", node,
                                  event.model(), valid.ToString());
            context.TryCancel();
            break;
          }
          store_->SetRemoteSources(node, event.model(), std::move(layouts));
          store_->ReserveStaging(event.model());
        }
        if (event.version() > 0) {
          std::vector<RemotePieceRef> pieces;
          for (const auto& p : event.pieces()) {
            pieces.push_back({p.buffer_id(), p.remote_key(), p.bytes()});
          }
          std::vector<RemoteDeltaRef> deltas;
          for (const auto& d : event.deltas()) {
            deltas.push_back(
                {d.buffer_id(), d.base_version(), d.version(), d.remote_key(), d.bytes()});
          }
          store_->AnnounceRemoteVersion(node, event.model(), event.version(), std::move(pieces),
                                        std::move(deltas));
        }
      }
      status = reader->Finish();
      {
        std::lock_guard<std::mutex> lock(mu_);
        peer->connected = false;
        peer->stream = nullptr;
      }
      metrics_->Add(kPeersConnected, -1);
      store_->ForgetRemoteVersions(node);
      data_plane_->Disconnect(node);
      Logger("peer")->warn("peer={} at {} disconnected: {}", node, peer->address,
                           status.error_message().empty() ? "stream ended"
                                                          : status.error_message());
    } else if (!reported_down) {
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        Logger("peer")->error("peer at {} refused: {}; retrying", peer->address,
                              status.error_message());
      } else {
        Logger("peer")->warn("peer at {} not answering ({}); retrying", peer->address,
                             status.error_message());
      }
      reported_down = true;
    }
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait_for(lock, backoff, [this] { return stop_; });
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

std::vector<PeerManager::Transfer> PeerManager::Transfers() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!current_) return {};
  Transfer t = *current_;
  const double done = metrics_->Get(kDataBytesReceived) - received_at_start_;
  t.bytes_done = std::min<uint64_t>(t.bytes_total, static_cast<uint64_t>(std::max(0.0, done)));
  return {t};
}

void PeerManager::OnPull(PullJob job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  wake_.notify_all();
}

v1::Peer::Stub* PeerManager::StubFor(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& peer : peers_) {
    if (peer->node == node && peer->connected) return peer->stub.get();
  }
  return nullptr;
}

void PeerManager::RunPulls() {
  while (true) {
    PullJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = Transfer{job.model, job.version, job.Bytes(), 0};
      received_at_start_ = metrics_->Get(kDataBytesReceived);
    }
    absl::Status status = Pull(job);
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_.reset();
    }
    metrics_->Observe(kTransferSeconds,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                          .count());
    if (status.ok()) {
      Logger("peer")->info("model={} version={} pulled {} bytes in {:.3f} s", job.model,
                           job.version, job.Bytes(),
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                               .count());
    }
  }
}

absl::Status PeerManager::Pull(const PullJob& job) {
  std::vector<std::shared_ptr<Region>> staging;
  auto finish = [&](absl::Status status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_.reset();  // before the store shows the version: no stale progress after it
    }
    store_->FinishPull(job, status, status.ok() ? staging : std::vector<std::shared_ptr<Region>>());
    return status;
  };
  // Pin the version on every node we read from, so --retain there can't free it under us.
  std::map<std::string, uint64_t> bytes_from;
  for (const auto& f : job.fetches) {
    for (const auto& [b, e] : f.ranges) bytes_from[f.node] += e - b;
  }
  auto pin = [&](const std::string& node, bool release) -> absl::Status {
    v1::Peer::Stub* stub = StubFor(node);
    if (!stub) return absl::UnavailableError(absl::StrCat("node ", node, " is not connected"));
    v1::PinRequest request;
    request.set_model(job.model);
    request.set_version(job.version);
    request.set_node(node_);
    request.set_release(release);
    request.set_lease_ms(pin_lease_ms_);
    request.set_bytes_read(release ? bytes_from[node] : 0);
    v1::PinResponse response;
    grpc::ClientContext context;
    context.set_deadline(In(kCallDeadline));
    grpc::Status s = stub->Pin(&context, request, &response);
    if (s.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("node ", node, ": ", s.error_message()));
  };
  for (const auto& [node, bytes] : bytes_from) {
    absl::Status pinned = pin(node, false);
    if (!pinned.ok()) return finish(pinned);
  }

  // Where a pull's time goes, for the debug log.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point pinned = Clock::now();
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  // Pieces this node can bring up to date from an older version by deltas; the rest in full.
  DeltaResult deltas = FetchDeltas(job, data_plane_, store_, delta_threshold_, metrics_);
  const double deltas_ms = ms_since(pinned);
  staging = std::move(deltas.staging);
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (!staging[f]) continue;
    uint64_t full_bytes = 0;
    for (const auto& [b, e] : job.fetches[f].ranges) full_bytes += e - b;
    bytes_from[job.fetches[f].node] += deltas.wire[f];
    bytes_from[job.fetches[f].node] -= full_bytes;
  }
  // The source hashes what we read while the bytes are still moving (not what deltas already
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
  PullJob full = job;
  full.fetches.clear();
  std::vector<size_t> full_index;
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (staging[f]) continue;
    full.fetches.push_back(job.fetches[f]);
    full_index.push_back(f);
  }
  const bool used_delta = full_index.size() < job.fetches.size();
  absl::Status status;
  auto read_hashes = std::make_shared<DataPlane::ReadHashes>();
  DataPlane::ReadHashes hashes(job.fetches.size());  // by the job's fetch index
  if (!full.fetches.empty()) {
    auto pulling = data_plane_->Pull(
        full, [this](uint64_t size) { return store_->AcquireSlot(size); }, read_hashes);
    // A long pull (a large model over a slow link) renews its pins before their lease lapses,
    // so no source recycles a slot while it is being read.
    while (pulling.wait_for(std::chrono::milliseconds(pin_lease_ms_ / 4)) !=
           std::future_status::ready) {
      for (const auto& [node, bytes] : bytes_from) (void)pin(node, false);
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
  if (status.ok()) status = Verify(job, staging, hashes, std::move(sums), verified);
  Logger("peer")->debug(
      "model={} version={} pull phases: deltas {:.1f} ms, data {:.1f} ms, then waited {:.1f} ms "
      "for the source's checksums, verify {:.1f} ms",
      job.model, job.version, deltas_ms, data_ms, sums_wait_ms,
      ms_since(pinned) - deltas_ms - data_ms - sums_wait_ms);
  for (const auto& [node, bytes] : bytes_from) (void)pin(node, true);
  if (status.ok()) metrics_->Add(used_delta ? kDeltaVersions : kFullVersions, 1);
  return finish(status);
}

absl::StatusOr<std::vector<uint64_t>> PeerManager::RemoteChecksums(
    const PullJob& job, size_t f, const std::vector<std::pair<uint64_t, uint64_t>>& chunks) {
  const PullJob::Fetch& fetch = job.fetches[f];
  const std::vector<RangeRun> runs = ToRuns(chunks);
  std::vector<uint64_t> sums;
  sums.reserve(chunks.size());
  size_t r = 0;
  uint64_t done_of_run = 0;  // ranges of runs[r] already asked for
  while (r < runs.size()) {
    v1::Peer::Stub* stub = StubFor(fetch.node);
    if (!stub) return absl::UnavailableError(absl::StrCat("node ", fetch.node, " went away"));
    v1::ChecksumRequest request;
    request.set_model(job.model);
    request.set_version(job.version);
    request.set_buffer_id(fetch.buffer_id);
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

grpc::Status PeerManager::CallChecksum(v1::Peer::Stub* stub, const v1::ChecksumRequest& request,
                                       v1::ChecksumResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(In(kCallDeadline));
  return stub->Checksum(&context, request, response);
}

absl::Status PeerManager::Verify(const PullJob& job,
                                 const std::vector<std::shared_ptr<Region>>& staging,
                                 const DataPlane::ReadHashes& read_hashes,
                                 std::vector<absl::StatusOr<std::vector<uint64_t>>> remote,
                                 const std::vector<bool>& verified) {
  for (size_t f = 0; f < job.fetches.size(); ++f) {
    if (verified[f]) continue;
    const PullJob::Fetch& fetch = job.fetches[f];
    std::vector<std::pair<uint64_t, uint64_t>> chunks = VerifyChunks(fetch);
    absl::StatusOr<std::vector<uint64_t>> sums = std::move(remote[f]);
    for (int attempt = 1;; ++attempt) {
      if (!sums.ok()) return sums.status();
      std::vector<std::pair<uint64_t, uint64_t>> bad;
      // The data plane hashed each read as it landed; a chunk no single read covered (another
      // --chunk-bytes, a refetch) is hashed here.
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
      if (attempt >= kFetchTries) {
        return absl::DataLossError(absl::StrCat(
            "model ", job.model, " version ", job.version, ": ", bad.size(),
            " chunks from node ", fetch.node, " still fail their checksum after ", attempt,
            " fetches"));
      }
      Logger("peer")->warn("model={} version={} node={} {} chunks failed their checksum; "
                           "fetching them again", job.model, job.version, fetch.node, bad.size());
      absl::Status again = data_plane_->Refetch(job, f, bad, staging[f]).get();
      if (!again.ok()) return again;
      chunks = bad;
      sums = RemoteChecksums(job, f, chunks);
    }
  }
  return absl::OkStatus();
}

}  // namespace refit::peer
