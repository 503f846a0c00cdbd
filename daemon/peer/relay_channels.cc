#include "daemon/peer/relay_channels.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/peer/peer_metrics.h"

namespace refit::peer {
namespace {

// After a relay channel failed to open, it is not tried again for this long.
constexpr auto kRedialAfter = std::chrono::milliseconds(2000);

}  // namespace

RelayChannels::RelayChannels(RelayChannelsOptions options, const Dialer* dialer, PeerLinks* links,
                             dataplane::DataPlane* data_plane, Metrics* metrics)
    : options_(options),
      dialer_(dialer),
      links_(links),
      data_plane_(data_plane),
      metrics_(metrics) {
  metrics_->Declare(kPeerChannelsOpen);
}

size_t RelayChannels::OpenLocked() const { return relays_.size() + links_->ConnectedCount(); }

size_t RelayChannels::Open() const {
  common::MutexLock lock(mu_);
  return OpenLocked();
}

void RelayChannels::Know(const std::string& node, const std::string& address) {
  common::MutexLock lock(mu_);
  known_[node] = address;
}

bool RelayChannels::CanReach(const std::string& node) {
  common::MutexLock lock(mu_);
  if (links_->Connected(node)) return true;
  return options_.relay && (relays_.count(node) > 0 || known_.count(node) > 0);
}

std::string RelayChannels::SiteOf(const std::string& node) {
  common::MutexLock lock(mu_);
  if (std::optional<std::string> site = links_->SiteOf(node)) return *site;
  if (auto relay = relays_.find(node); relay != relays_.end()) return relay->second.site;
  return "";
}

v1::Peer::Stub* RelayChannels::StubFor(const std::string& node) {
  {
    common::MutexLock lock(mu_);
    if (v1::Peer::Stub* stub = links_->Connected(node)) return stub;
    if (!options_.relay) return nullptr;
    if (auto relay = relays_.find(node); relay != relays_.end()) {
      relay->second.used = std::chrono::steady_clock::now();
      return relay->second.stub.get();
    }
    if (known_.count(node) == 0) return nullptr;
  }
  return OpenRelay(node);
}

v1::Peer::Stub* RelayChannels::OpenRelay(const std::string& node) {
  common::MutexLock opening(open_mu_);
  std::string address;
  {
    common::MutexLock lock(mu_);
    if (stop_) return nullptr;
    if (v1::Peer::Stub* stub = links_->Connected(node)) return stub;  // its --peers entry came up
    if (auto relay = relays_.find(node); relay != relays_.end()) {    // opened meanwhile
      relay->second.used = std::chrono::steady_clock::now();
      return relay->second.stub.get();
    }
    auto known = known_.find(node);
    if (known == known_.end()) return nullptr;
    if (OpenLocked() >= options_.max_channels) {
      Logger("peer")->debug(
          "not opening a relay channel to node {}: {} channels open "
          "(--max-peer-connections)",
          node, options_.max_channels);
      return nullptr;
    }
    if (auto failed = dial_failed_.find(node);
        failed != dial_failed_.end() &&
        std::chrono::steady_clock::now() - failed->second < kRedialAfter) {
      return nullptr;
    }
    address = known->second;
  }
  Dialed dialed;
  grpc::Status status = dialer_->Dial(address, &dialed);
  if (status.ok() && dialed.who.node() != node) {
    status =
        grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                     absl::StrCat("it answers as node '", dialed.who.node().substr(0, 64), "'"));
  }
  common::MutexLock lock(mu_);
  if (!status.ok() || stop_) {
    if (!status.ok()) {
      dial_failed_[node] = std::chrono::steady_clock::now();
      Logger("peer")->warn("relay channel to node {} at {} not opened: {}", node, address,
                           status.error_message());
    }
    return nullptr;
  }
  dial_failed_.erase(node);
  if (!dialed.who.transport_address().empty()) {
    data_plane_->Connect(node, dialed.who.transport_address());
  }
  Relay& relay = relays_[node];
  relay.site = dialed.who.site().size() <= kMaxNodeName ? dialed.who.site() : "";
  relay.channel = std::move(dialed.channel);
  relay.stub = std::move(dialed.stub);
  relay.used = std::chrono::steady_clock::now();
  metrics_->Add(kPeerChannelsOpen, 1);
  Logger("peer")->info("relay channel to node {} at {} open ({} channels)", node, address,
                       OpenLocked());
  return relay.stub.get();
}

void RelayChannels::BeginPull() {
  common::MutexLock lock(mu_);
  pulling_ = true;
}

void RelayChannels::EndPull() {
  common::MutexLock lock(mu_);
  pulling_ = false;
}

void RelayChannels::CloseIdle() {
  common::MutexLock opening(open_mu_);
  common::MutexLock lock(mu_);
  if (pulling_) return;  // its stubs may be in use
  links_->ClearRetired();
  const auto now = std::chrono::steady_clock::now();
  for (auto it = relays_.begin(); it != relays_.end();) {
    if (now - it->second.used < options_.idle && !stop_) {
      ++it;
      continue;
    }
    // A --peers connection to the same node (it came up meanwhile) owns the endpoint now.
    if (!links_->Connected(it->first)) data_plane_->Disconnect(it->first);
    metrics_->Add(kPeerChannelsOpen, -1);
    Logger("peer")->info("relay channel to node {} closed (idle)", it->first);
    it = relays_.erase(it);
  }
}

void RelayChannels::Stop() {
  common::MutexLock lock(mu_);
  stop_ = true;
  for (const auto& relay : relays_) data_plane_->Disconnect(relay.first);
}

}  // namespace refit::peer
