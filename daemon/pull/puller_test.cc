// pull::Puller in one process: a real Store (slots), two real DataPlanes over the in-process
// transport (daemon/transport/inproc), and a fake origin's Peer service (Pin, Checksum) on an
// in-process gRPC channel. Fast and deterministic; the multi-process tests (tests/two_node_*,
// tests/peer_plane_test, tests/faults_peer_test ...) stay beside it.

#include "daemon/pull/puller.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/dataplane/data_plane.h"
#include "daemon/dataplane/data_plane_testing.h"
#include "daemon/fleet/stripes.h"
#include "daemon/memory/checksum.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pull/relay_read.h"
#include "daemon/store/store.h"
#include "daemon/store/store_testing.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::pull {
namespace {

constexpr char kOrigin[] = "origin";
constexpr char kPuller[] = "puller";
constexpr char kRelay[] = "relay";
constexpr uint64_t kBytes = 2 * kChecksumChunkBytes + kChecksumChunkBytes / 2;  // 3 chunks

// The origin's side of the control plane: pins counted, checksums of `truth` (the bytes the
// version really holds), whatever its data plane serves.
class FakeOrigin final : public v1::Peer::Service {
 public:
  explicit FakeOrigin(std::vector<uint8_t> truth) : truth_(std::move(truth)) {}

  grpc::Status Pin(grpc::ServerContext*, const v1::PinRequest* request, v1::PinResponse*) override {
    (request->release() ? releases : pins)++;
    return grpc::Status::OK;
  }

  grpc::Status Checksum(grpc::ServerContext*, const v1::ChecksumRequest* request,
                        v1::ChecksumResponse* response) override {
    if (before_checksum) before_checksum();
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const v1::RangeRun& run : request->runs()) {
      for (uint64_t i = 0; i < run.count(); ++i) {
        const uint64_t begin = run.offset() + i * run.stride();
        ranges.emplace_back(begin, std::min<uint64_t>(truth_.size(), begin + run.length()));
      }
    }
    for (uint64_t sum : HashRanges(truth_.data(), ranges)) response->add_sums(sum);
    checksum_calls++;
    return grpc::Status::OK;
  }

  std::atomic<int> pins{0};
  std::atomic<int> releases{0};
  std::atomic<int> checksum_calls{0};
  // Runs at the start of each Checksum call (on a gRPC thread); set before the pull.
  std::function<void()> before_checksum;

 private:
  const std::vector<uint8_t> truth_;
};

// The peer manager's part: one channel, to the origin (or none).
class OneChannel final : public PeerChannels {
 public:
  explicit OneChannel(v1::Peer::Stub* stub) : stub_(stub) {}
  v1::Peer::Stub* StubFor(const std::string& node) override {
    return node == kOrigin ? stub_ : nullptr;
  }

 private:
  v1::Peer::Stub* const stub_;
};

// Another puller of the version, dead: every Relay stream fails at once (its process went away).
class DeadRelay final : public v1::Peer::Service {
 public:
  grpc::Status Relay(grpc::ServerContext*, const v1::RelayRequest*,
                     grpc::ServerWriter<v1::RelayProgress>*) override {
    streams++;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "relay went away");
  }
  grpc::Status Pin(grpc::ServerContext*, const v1::PinRequest*, v1::PinResponse*) override {
    pins++;
    return grpc::Status::OK;
  }
  std::atomic<int> streams{0};
  std::atomic<int> pins{0};
};

// Another puller of the version that answers its reader, says it plans to hold the whole piece,
// and then never announces anything: with `heartbeat`, it keeps writing empty messages (no
// progress); without, it writes nothing more while the connection stays up (a wedged or hostile
// relay). Its stream ends only when the reader cancels it.
class SilentRelay final : public v1::Peer::Service {
 public:
  SilentRelay(uint64_t bytes, bool heartbeat) : bytes_(bytes), heartbeat_(heartbeat) {}
  grpc::Status Relay(grpc::ServerContext* context, const v1::RelayRequest*,
                     grpc::ServerWriter<v1::RelayProgress>* writer) override {
    streams++;
    v1::RelayProgress first;
    first.set_bytes(bytes_);
    first.set_remote_key("never read");
    v1::ByteRange* all = first.add_planned();
    all->set_offset(0);
    all->set_length(bytes_);
    if (!writer->Write(first)) return grpc::Status::OK;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(5);
    while (!context->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (heartbeat_ && !writer->Write(v1::RelayProgress())) break;
    }
    if (context->IsCancelled()) cancelled++;
    return grpc::Status::CANCELLED;
  }
  std::atomic<int> streams{0};
  std::atomic<int> cancelled{0};

 private:
  const uint64_t bytes_;
  const bool heartbeat_;
};

// The origin's channel and a relay's.
class OriginAndRelay final : public PeerChannels {
 public:
  OriginAndRelay(v1::Peer::Stub* origin, v1::Peer::Stub* relay) : origin_(origin), relay_(relay) {}
  v1::Peer::Stub* StubFor(const std::string& node) override {
    if (node == kOrigin) return origin_;
    return node == kRelay ? relay_ : nullptr;
  }

 private:
  v1::Peer::Stub* const origin_;
  v1::Peer::Stub* const relay_;
};

std::vector<uint8_t> Pattern(uint64_t size) {
  std::vector<uint8_t> bytes(size);
  for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>((i * 131 + (i >> 12)) & 0xff);
  return bytes;
}

// The in-process transport, but each Poll hands its completions back in reverse order: reads
// of a pull complete out of the order they were posted in.
class ReversingTransport final : public transport::Transport {
 public:
  ReversingTransport() : inner_(transport::InprocTransport::Create()) {}
  const transport::Capabilities& capabilities() const override { return inner_->capabilities(); }
  const std::string& LocalAddress() const override { return inner_->LocalAddress(); }
  absl::StatusOr<std::unique_ptr<transport::LocalMemory>> RegisterMemory(void* address,
                                                                         uint64_t length,
                                                                         MemoryKind kind) override {
    return inner_->RegisterMemory(address, length, kind);
  }
  absl::StatusOr<std::unique_ptr<transport::LocalMemory>> AllocateMemory(uint64_t length) override {
    return inner_->AllocateMemory(length);
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> Connect(
      std::string_view peer_address) override {
    return inner_->Connect(peer_address);
  }
  size_t Poll(std::vector<transport::Completion>* out) override {
    const size_t before = out->size();
    const size_t n = inner_->Poll(out);
    std::reverse(out->begin() + static_cast<std::ptrdiff_t>(before), out->end());
    if (n > 1) reversed_polls++;
    completions += static_cast<int>(n);
    return n;
  }
  uint64_t outstanding() const override { return inner_->outstanding(); }
  absl::StatusOr<Grant> GrantRead(const transport::LocalMemory& memory,
                                  std::string_view token) override {
    return inner_->GrantRead(memory, token);
  }
  uint64_t activity() const override { return inner_->activity(); }
  bool PrepareToSleep() override { return inner_->PrepareToSleep(); }
  int WakeFd() const override { return inner_->WakeFd(); }

  // Polls that handed back more than one completion (reordered); read after the pull.
  std::atomic<int> reversed_polls{0};
  std::atomic<int> completions{0};  // reads completed (each PostGet or gather is one)

 private:
  std::unique_ptr<transport::InprocTransport> inner_;
};

// Two nodes in one process: the origin's data plane exposes a version slot holding `truth`,
// the puller's reads it.
struct TwoNodes {
  // `puller_transport` (null: the in-process one) and `options`: the puller's data plane.
  explicit TwoNodes(std::vector<uint8_t> truth_bytes,
                    std::unique_ptr<transport::Transport> puller_transport = nullptr,
                    dataplane::DataPlaneOptions options = dataplane::TestDataPlaneOptions())
      : truth(std::move(truth_bytes)),
        origin_plane(transport::InprocTransport::Create(), dataplane::TestDataPlaneOptions(),
                     &origin_metrics),
        puller_plane(
            puller_transport ? std::move(puller_transport) : transport::InprocTransport::Create(),
            options, &puller_metrics),
        store(refit::testing::TestStoreOptions(), &puller_metrics),
        service(truth) {
    auto slot_or = origin_plane.AllocateSlot(truth.size());
    REQUIRE(slot_or.ok());
    slot = std::shared_ptr<Region>(std::move(*slot_or));
    std::memcpy(slot->data(), truth.data(), truth.size());
    auto exposed = origin_plane.Expose(slot, kPuller);
    REQUIRE(exposed.ok());
    grant = exposed->grant;
    puller_plane.Connect(kOrigin, origin_plane.LocalAddress());
    grpc::ServerBuilder builder;
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server);
    stub = v1::Peer::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
    job.model = "m";
    job.version = 1;
    PullJob::Fetch fetch;
    fetch.node = kOrigin;
    fetch.buffer_id = "b";
    fetch.remote_key = exposed->descriptor;
    fetch.bytes = truth.size();
    fetch.ranges = {{0, truth.size()}};
    job.fetches.push_back(fetch);
  }
  ~TwoNodes() { server->Shutdown(); }

  // `replicas` (may be null): the other pullers this node may read stripes from (relaying on).
  PullOutcome Pull(PeerChannels* channels, fleet::ReplicaTable* replicas = nullptr,
                   StreamLimits relay_limits = {}) {
    PullerOptions options;
    options.node = kPuller;
    options.delta_threshold = 0;  // full bytes only: these jobs carry no deltas
    options.relay = replicas != nullptr;
    options.relay_limits = relay_limits;
    Puller puller(options, &store, &puller_plane, &puller_metrics, channels, nullptr, replicas);
    return puller.Pull(job);
  }

  const std::vector<uint8_t> truth;
  Metrics origin_metrics;
  Metrics puller_metrics;
  dataplane::DataPlane origin_plane;
  dataplane::DataPlane puller_plane;
  Store store;
  FakeOrigin service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Peer::Stub> stub;
  std::shared_ptr<Region> slot;
  std::shared_ptr<void> grant;
  PullJob job;
};

bool SameBytes(const Region& region, const std::vector<uint8_t>& bytes) {
  return region.size() >= bytes.size() &&
         std::memcmp(region.data(), bytes.data(), bytes.size()) == 0;
}

TEST_CASE("a pull completes, byte-equal, pinned and released on the origin") {
  TwoNodes nodes(Pattern(kBytes));
  OneChannel channels(nodes.stub.get());
  PullOutcome outcome = nodes.Pull(&channels);
  REQUIRE(outcome.status.ok());
  REQUIRE(outcome.staging.size() == 1);
  CHECK(SameBytes(*outcome.staging[0], nodes.truth));
  CHECK(nodes.service.pins >= 1);
  CHECK(nodes.service.releases == 1);
  CHECK(nodes.service.checksum_calls == 1);
  CHECK(nodes.puller_metrics.Get(kFullVersions) == 1);
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 0);
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) == static_cast<double>(kBytes));
}

TEST_CASE("a corrupt chunk fails its checksum, is fetched again (counted), and the pull is exact") {
  std::vector<uint8_t> truth = Pattern(kBytes);
  TwoNodes nodes(truth);
  // The origin's slot serves one wrong byte in the second chunk until the first read is in.
  const uint64_t at = kChecksumChunkBytes + 17;
  nodes.slot->data()[at] ^= 0x5a;
  std::atomic<bool> healed{false};
  nodes.service.before_checksum = [&] {
    if (healed.exchange(true)) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (nodes.puller_metrics.Get(kDataBytesReceived) < static_cast<double>(kBytes) &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    nodes.slot->data()[at] = truth[at];
  };
  OneChannel channels(nodes.stub.get());
  PullOutcome outcome = nodes.Pull(&channels);
  REQUIRE(outcome.status.ok());
  CHECK(SameBytes(*outcome.staging[0], truth));
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 1);
  CHECK(nodes.service.checksum_calls == 2);  // the pull's, and the refetched chunk's
  // The refetch read one chunk again.
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) ==
        static_cast<double>(kBytes + kChecksumChunkBytes));
}

TEST_CASE("a chunk that never matches the origin's checksum fails the pull with DATA_LOSS") {
  std::vector<uint8_t> truth = Pattern(kBytes);
  TwoNodes nodes(truth);
  nodes.slot->data()[3] ^= 0x01;  // served wrong, every time
  OneChannel channels(nodes.stub.get());
  PullOutcome outcome = nodes.Pull(&channels);
  CHECK(outcome.status.code() == absl::StatusCode::kDataLoss);
  CHECK(outcome.staging.empty());
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 2);  // 3 fetches in all
  CHECK(nodes.puller_metrics.Get(kFullVersions) == 0);
  CHECK(nodes.service.releases == 1);  // unpinned all the same
}

TEST_CASE("a pull from an origin with no channel fails UNAVAILABLE and reads nothing") {
  TwoNodes nodes(Pattern(kBytes));
  OneChannel none(nullptr);
  PullOutcome outcome = nodes.Pull(&none);
  CHECK(outcome.status.code() == absl::StatusCode::kUnavailable);
  CHECK(outcome.staging.empty());
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) == 0);
}

}  // namespace
}  // namespace refit::pull

namespace refit::pull {
namespace {

// A relay that answers every Relay call with an ended stream (DeadRelay), the replica table that
// names it, and the channels to it and to `nodes`' origin: this node is dealt stripes it relays
// and reads the relay's from the origin after each failed stream.
struct DeadRelayNode {
  explicit DeadRelayNode(TwoNodes& nodes) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&relay);
    server = builder.BuildAndStart();
    REQUIRE(server);
    stub = v1::Peer::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
    REQUIRE(replicas.Report(kRelay, /*relay=*/true, {{"m", 0, 0, false}}, "").ok());
    channels = std::make_unique<OriginAndRelay>(nodes.stub.get(), stub.get());
  }
  ~DeadRelayNode() { server->Shutdown(); }

  DeadRelay relay;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Peer::Stub> stub;
  fleet::ReplicaTable replicas;
  std::unique_ptr<OriginAndRelay> channels;
};

TEST_CASE("a dead relay's stripes are read from the origin (a failover, counted), byte-equal") {
  // Enough chunks that the relay is dealt some of them.
  std::vector<uint8_t> truth = Pattern(8 * kChecksumChunkBytes);
  TwoNodes nodes(truth);
  DeadRelayNode dead(nodes);
  DeadRelay& relay = dead.relay;
  PullOutcome outcome = nodes.Pull(dead.channels.get(), &dead.replicas);
  REQUIRE(outcome.status.ok());
  CHECK(SameBytes(*outcome.staging[0], truth));
  CHECK(relay.streams >= 1);
  CHECK(nodes.puller_metrics.Get(kRelayFailovers) == relay.streams.load());
  CHECK(nodes.puller_metrics.Get(kRelayBytesReceived) == 0);
  // Every byte came from the origin, once: nothing refetched.
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) == static_cast<double>(truth.size()));
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 0);
}

}  // namespace
}  // namespace refit::pull

namespace refit::pull {
namespace {

TEST_CASE(
    "the stripes this node relays are read from the origin in --relay-chunk-bytes reads, the "
    "rest in --chunk-bytes; off-grid digests are hashed again and the pull verifies") {
  std::vector<uint8_t> truth = Pattern(8 * kChecksumChunkBytes);
  auto transport = std::make_unique<ReversingTransport>();
  ReversingTransport* counting = transport.get();
  dataplane::DataPlaneOptions options = dataplane::TestDataPlaneOptions();
  options.chunk_bytes = kChecksumChunkBytes;
  options.relay_chunk_bytes = kChecksumChunkBytes / 8;
  TwoNodes nodes(truth, std::move(transport), options);
  DeadRelayNode dead(nodes);
  PullOutcome outcome = nodes.Pull(dead.channels.get(), &dead.replicas);
  REQUIRE(outcome.status.ok());
  CHECK(SameBytes(*outcome.staging[0], truth));
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 0);
  // The stripes dealt to this node (it relays them) in eighth-chunk reads; the dead relay's,
  // read from the origin after it failed, in whole chunks.
  fleet::SiteView view;
  view.self = kPuller;
  view.local = {kPuller, kRelay};
  const auto by_parent = ByParent(nodes.job.fetches[0], view);
  REQUIRE(by_parent.count(kOrigin) == 1);
  REQUIRE(by_parent.count(kRelay) == 1);
  const uint64_t own = Total(by_parent.at(kOrigin));
  const uint64_t dealt = Total(by_parent.at(kRelay));
  CHECK(own + dealt == truth.size());
  CHECK(static_cast<uint64_t>(counting->completions.load()) ==
        own / options.relay_chunk_bytes + dealt / options.chunk_bytes);
}

TEST_CASE("reads completing out of order still make an exact pull") {
  std::vector<uint8_t> truth = Pattern(kBytes);
  auto transport = std::make_unique<ReversingTransport>();
  ReversingTransport* reversing = transport.get();
  dataplane::DataPlaneOptions options = dataplane::TestDataPlaneOptions();  // 16 in flight
  options.chunk_bytes = 1 << 20;  // 10 reads, up to 16 in flight: one Poll completes several
  TwoNodes nodes(truth, std::move(transport), options);
  OneChannel channels(nodes.stub.get());
  PullOutcome outcome = nodes.Pull(&channels);
  REQUIRE(outcome.status.ok());
  CHECK(SameBytes(*outcome.staging[0], truth));
  CHECK(reversing->reversed_polls >= 1);
  CHECK(nodes.puller_metrics.Get(kChunksRefetched) == 0);
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) == static_cast<double>(kBytes));
}

}  // namespace
}  // namespace refit::pull

namespace refit::pull {
namespace {

// A relay that keeps its connection but never writes again (or writes only heartbeats that
// announce nothing): the reader's watchdog cancels its stream after StreamLimits::silence (or
// ::stall), and its stripes come from the origin. Without the watchdog the pull would wait for
// the stream's 30-minute deadline (and this test for its timeout).
void PullPastSilentRelay(bool heartbeat) {
  std::vector<uint8_t> truth = Pattern(8 * kChecksumChunkBytes);
  TwoNodes nodes(truth);
  SilentRelay relay(truth.size(), heartbeat);
  grpc::ServerBuilder builder;
  builder.RegisterService(&relay);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server);
  auto relay_stub = v1::Peer::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  fleet::ReplicaTable replicas;
  REQUIRE(replicas.Report(kRelay, /*relay=*/true, {{"m", 0, 0, false}}, "").ok());
  OriginAndRelay channels(nodes.stub.get(), relay_stub.get());
  StreamLimits limits;
  limits.silence = std::chrono::milliseconds(heartbeat ? 60000 : 300);
  limits.stall = std::chrono::milliseconds(heartbeat ? 500 : 60000);
  PullOutcome outcome = nodes.Pull(&channels, &replicas, limits);
  REQUIRE(outcome.status.ok());
  CHECK(SameBytes(*outcome.staging[0], truth));
  CHECK(nodes.puller_metrics.Get(kRelayBytesReceived) == 0);
  CHECK(nodes.puller_metrics.Get(kDataBytesReceived) == static_cast<double>(truth.size()));
  server->Shutdown();  // waits for the relay's handlers to see their streams end
  CHECK(relay.streams >= 1);
  CHECK(relay.cancelled == relay.streams.load());
  CHECK(nodes.puller_metrics.Get(kRelayFailovers) == relay.streams.load());
}

TEST_CASE("a relay that goes silent with its connection up is given up on; the origin serves") {
  PullPastSilentRelay(/*heartbeat=*/false);
}

TEST_CASE("a relay that only sends heartbeats, never progress, is given up on after the stall") {
  PullPastSilentRelay(/*heartbeat=*/true);
}

}  // namespace
}  // namespace refit::pull
