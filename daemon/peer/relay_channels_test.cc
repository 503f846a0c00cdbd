// The peer plane's channel logic in one process: RelayChannels (relay channels opened on demand
// to nodes an origin named, the --max-peer-connections cap, idle close, no close during a pull,
// a node answering under another name) and ReplicaReporter::Learn, against fake daemons that
// answer Hello on loopback (port 0: the system picks a free one).

#include "daemon/peer/relay_channels.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "catch2/catch.hpp"
#include "daemon/dataplane/data_plane.h"
#include "daemon/dataplane/data_plane_testing.h"
#include "daemon/fleet/replicas.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_dial.h"
#include "daemon/peer/peer_events.h"
#include "daemon/peer/peer_links.h"
#include "daemon/peer/peer_metrics.h"
#include "daemon/peer/replica_reporter.h"
#include "daemon/store/store.h"
#include "daemon/store/store_testing.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {
namespace {

// A daemon that answers Hello as `node`.
class FakeDaemon final : public v1::Peer::Service {
 public:
  explicit FakeDaemon(std::string node) : node_(std::move(node)) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_);
    REQUIRE(port > 0);
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~FakeDaemon() override { server_->Shutdown(); }

  grpc::Status Hello(grpc::ServerContext*, const v1::HelloRequest*,
                     v1::HelloResponse* response) override {
    hellos++;
    response->set_node(node_);
    response->set_site("east");
    return grpc::Status::OK;
  }

  std::string address;
  std::atomic<int> hellos{0};

 private:
  const std::string node_;
  std::unique_ptr<grpc::Server> server_;
};

// This node's side: no --peers, no transport (endpoints are no-ops).
struct Node {
  explicit Node(RelayChannelsOptions options)
      : dialer("self", "instance-1", tls::PeerTlsFiles{}),
        data_plane(nullptr, dataplane::TestDataPlaneOptions(), &metrics),
        store(refit::testing::TestStoreOptions(), &metrics),
        events(&store, rl::Parts{}, &replicas),
        links(&dialer, &events, &data_plane, &metrics),
        channels(options, &dialer, &links, &data_plane, &metrics) {}

  Metrics metrics;
  fleet::ReplicaTable replicas;
  Dialer dialer;
  dataplane::DataPlane data_plane;
  Store store;
  PeerEvents events;
  PeerLinks links;
  RelayChannels channels;
};

RelayChannelsOptions Options(uint32_t max_channels, std::chrono::milliseconds idle) {
  RelayChannelsOptions options;
  options.relay = true;
  options.max_channels = max_channels;
  options.idle = idle;
  return options;
}

TEST_CASE("a relay channel opens on demand to a known node, once, and closes when idle") {
  FakeDaemon b("b");
  Node node(Options(16, std::chrono::milliseconds(0)));
  CHECK_FALSE(node.channels.CanReach("b"));
  CHECK(node.channels.StubFor("b") == nullptr);  // nobody named it yet
  node.channels.Know("b", b.address);
  CHECK(node.channels.CanReach("b"));
  CHECK(b.hellos == 0);  // CanReach opens nothing
  v1::Peer::Stub* stub = node.channels.StubFor("b");
  REQUIRE(stub != nullptr);
  CHECK(node.channels.StubFor("b") == stub);  // open: the same channel
  CHECK(b.hellos == 1);
  CHECK(node.channels.Open() == 1);
  CHECK(node.channels.SiteOf("b") == "east");
  CHECK(node.metrics.Get(kPeerChannelsOpen) == 1);

  // Not while a pull may hold its stub.
  node.channels.BeginPull();
  node.channels.CloseIdle();
  CHECK(node.channels.Open() == 1);
  node.channels.EndPull();
  node.channels.CloseIdle();
  CHECK(node.channels.Open() == 0);
  CHECK(node.metrics.Get(kPeerChannelsOpen) == 0);
  CHECK(node.channels.CanReach("b"));  // still known: it opens again when needed
}

TEST_CASE("no relay channel opens past --max-peer-connections") {
  FakeDaemon b("b");
  FakeDaemon c("c");
  Node node(Options(1, std::chrono::minutes(1)));
  node.channels.Know("b", b.address);
  node.channels.Know("c", c.address);
  REQUIRE(node.channels.StubFor("b") != nullptr);
  CHECK(node.channels.StubFor("c") == nullptr);
  CHECK(c.hellos == 0);
  CHECK(node.channels.Open() == 1);
}

TEST_CASE("a node answering under another name gets no channel, and is not dialled again at once") {
  FakeDaemon impostor("not-b");
  Node node(Options(16, std::chrono::minutes(1)));
  node.channels.Know("b", impostor.address);
  CHECK(node.channels.StubFor("b") == nullptr);
  CHECK(node.channels.StubFor("b") == nullptr);
  CHECK(impostor.hellos == 1);  // the second ask came within the 2 s redial pause
  CHECK(node.channels.Open() == 0);
}

TEST_CASE("without --relay only --peers nodes are reached") {
  FakeDaemon b("b");
  RelayChannelsOptions options = Options(16, std::chrono::minutes(1));
  options.relay = false;
  Node node(options);
  node.channels.Know("b", b.address);
  CHECK_FALSE(node.channels.CanReach("b"));
  CHECK(node.channels.StubFor("b") == nullptr);
  CHECK(b.hellos == 0);
}

TEST_CASE("the reporter learns the other pullers an origin names, and not itself or bad entries") {
  Node node(Options(16, std::chrono::minutes(1)));
  ReplicaReporter reporter(ReplicaReporterOptions{"self", true, ""}, &node.store, &node.links,
                           &node.channels, &node.replicas);
  v1::ReplicaReportResponse response;
  auto add = [&response](const std::string& name, const std::string& listen) {
    v1::FleetMember* member = response.add_members();
    member->set_node(name);
    member->set_listen(listen);
    member->set_relay(true);
    v1::ReplicaReport::Model* model = member->add_models();
    model->set_model("m");
    model->set_latest_version(3);
  };
  add("b", "127.0.0.1:1");
  add("self", "127.0.0.1:2");       // this node
  add("c", "");                     // no address
  add(std::string(300, 'x'), "a");  // a name too long
  reporter.Learn(response);
  CHECK(node.channels.CanReach("b"));
  CHECK_FALSE(node.channels.CanReach("self"));
  CHECK_FALSE(node.channels.CanReach("c"));
  CHECK(node.replicas.Relays("m") == std::vector<std::string>{"b"});
}

}  // namespace
}  // namespace refit::peer
