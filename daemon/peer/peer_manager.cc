#include "daemon/peer/peer_manager.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/test_hooks.h"

namespace refit::peer {
namespace {

using std::chrono::milliseconds;

// A reader's pin on a source's version lapses after its lease unless renewed; a pull renews its
// pins every quarter lease. 2 minutes; tests shorten it with $REFIT_TEST_PIN_LEASE_MS (the
// source takes at least 1 s).
constexpr uint32_t kPinLeaseMs = 120000;

uint32_t PinLeaseMs() {
  if (const char* test = TestSwitch("REFIT_TEST_PIN_LEASE_MS")) {
    if (const long ms = std::strtol(test, nullptr, 10); ms > 0) return static_cast<uint32_t>(ms);
  }
  return kPinLeaseMs;
}

// A relay channel unused this long is closed; $REFIT_TEST_RELAY_IDLE_MS in test builds.
milliseconds RelayIdle() {
  if (const char* test = TestSwitch("REFIT_TEST_RELAY_IDLE_MS")) {
    if (const long ms = std::strtol(test, nullptr, 10); ms > 0) return milliseconds(ms);
  }
  return milliseconds(60000);
}

}  // namespace

pull::PullerOptions PullerOptionsFor(const PeerManagerOptions& options) {
  pull::PullerOptions pull;
  pull.node = options.node;
  pull.delta_threshold = options.delta_threshold;
  pull.pin_lease_ms = PinLeaseMs();
  pull.relay = options.relay;
  pull.site = options.site;
  pull.timeline = options.rl.timeline;
  return pull;
}

RelayChannelsOptions RelayChannelsOptionsFor(const PeerManagerOptions& options) {
  RelayChannelsOptions channels;
  channels.relay = options.relay;
  channels.max_channels = std::max<uint32_t>(1, options.max_peer_connections);
  channels.idle = RelayIdle();
  return channels;
}

ReplicaReporterOptions ReplicaReporterOptionsFor(const PeerManagerOptions& options) {
  return ReplicaReporterOptions{options.node, options.relay, options.site};
}

PeerManager::PeerManager(PeerManagerOptions options, std::vector<std::string> addresses,
                         PeerStore* store, DataPlane* data_plane, Metrics* metrics,
                         fleet::RelayBoard* board, fleet::ReplicaTable* replicas)
    : node_(options.node),
      dialer_(options.node, options.instance, options.tls),
      events_(store, options.rl, replicas),
      links_(&dialer_, &events_, data_plane, metrics),
      resolver_(std::move(addresses), &links_),
      channels_(RelayChannelsOptionsFor(options), &dialer_, &links_, data_plane, metrics),
      puller_(PullerOptionsFor(options), store, data_plane, metrics, &channels_, board, replicas),
      runner_(&puller_),
      finisher_(store),
      pulls_(&runner_, &finisher_, &channels_, metrics),
      reporter_(ReplicaReporterOptionsFor(options), store, &links_, &channels_, replicas) {}

PeerManager::~PeerManager() { Stop(); }

void PeerManager::Start() {
  resolver_.Start();
  pulls_.Start();
  reporter_.Start();
}

void PeerManager::Stop() {
  if (stopped_.exchange(true)) return;
  // Dropping the endpoints cancels a pull in flight, so the pull worker can finish.
  links_.Stop();
  channels_.Stop();
  resolver_.Stop();
  reporter_.Stop();
  links_.Join();
  pulls_.Stop();
}

void PeerManager::OnPullNeeded(const PullJob& job) { pulls_.Queue(job); }

void PeerManager::OnVersionComplete(const std::string& /*model*/, uint64_t /*version*/) {
  reporter_.Notify();
}

void PeerManager::OnHoldChanged(const std::string& /*model*/, uint64_t /*version*/) {
  reporter_.Notify();
}

absl::Status PeerManager::ForwardHold(const std::string& model, uint64_t version,
                                      const std::vector<std::string>& nodes) {
  for (const std::string& node : nodes) {
    std::shared_ptr<v1::Peer::Stub> stub = links_.ConnectedShared(node);
    const char* what = version == 0 ? "resume" : "rollback";
    if (!stub) {
      return absl::UnavailableError(
          absl::StrCat("model ", model, ": node ", node,
                       " (it has SOURCE buffers of the model) is not connected: the ", what,
                       " cannot reach the fleet through it; try again once it is"));
    }
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(milliseconds(5000)));
    v1::HoldRequest request;
    request.set_model(model);
    request.set_version(version);
    request.set_node(node_);
    v1::HoldResponse response;
    grpc::Status status = stub->Hold(&context, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("node ", node, ": ", status.error_message()));
    }
    Logger("peer")->info("model={} {} to version {} told to node {}", model, what, version, node);
  }
  return absl::OkStatus();
}

}  // namespace refit::peer
