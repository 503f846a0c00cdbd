#pragma once

// The control channels a pull uses, by node (pull::PeerChannels): a connected --peers node's
// (PeerLinks); else, with --relay, a relay channel to a node an origin named in its answer to
// this node's replica report (Know), opened on demand (Hello, data-plane endpoint) while fewer
// than --max-peer-connections channels are open, and closed once unused for a while
// (CloseIdle). A channel that failed to open is not tried again for 2 s.
//
// Stubs are handed out as plain pointers: between BeginPull and EndPull none is freed (no relay
// channel closes, no stub a reconnect replaced goes away).
//
// Thread-safety: every method may be called from any thread.

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "daemon/common/mutex.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_dial.h"
#include "daemon/peer/peer_links.h"
#include "daemon/peer/pull_worker.h"
#include "daemon/pull/puller.h"

namespace refit::peer {

// relay and max_channels are refitd's --relay and --max-peer-connections (PeerManager passes
// them on; their defaults live in DaemonOptions alone): unset, no relay channel opens.
struct RelayChannelsOptions {
  bool relay = false;  // --relay: off, only --peers nodes are reached
  // --max-peer-connections: relay channels open only while fewer channels than this are open
  // (--peers connections count, and are always made).
  uint32_t max_channels = 0;
  // A relay channel unused this long is closed.
  std::chrono::milliseconds idle{60000};
};

class RelayChannels final : public pull::PeerChannels, public PullsInFlight {
 public:
  // Nothing is owned.
  RelayChannels(RelayChannelsOptions options, const Dialer* dialer, PeerLinks* links,
                dataplane::DataPlane* data_plane, Metrics* metrics);

  // pull::PeerChannels.
  v1::Peer::Stub* StubFor(const std::string& node) override;
  bool CanReach(const std::string& node) override;
  std::string SiteOf(const std::string& node) override;

  // `node` listens at `address` (an origin said so); a relay channel to it may open.
  void Know(const std::string& node, const std::string& address);
  // Control channels open now: --peers connected plus relay channels.
  size_t Open() const;
  // A pull is running / ended: no stub is freed in between.
  void BeginPull() override;
  void EndPull() override;
  // Closes relay channels unused for `idle` (all of them after Stop), and frees the stubs
  // reconnects replaced; nothing while a pull runs.
  void CloseIdle();
  // Drops every relay channel's data-plane endpoint (a pull in flight fails); opens no more.
  void Stop();

 private:
  struct Relay {
    std::string site;  // its Hello's
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<v1::Peer::Stub> stub;
    std::chrono::steady_clock::time_point used;
  };
  v1::Peer::Stub* OpenRelay(const std::string& node);
  size_t OpenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RelayChannelsOptions options_;
  const Dialer* const dialer_;
  PeerLinks* const links_;
  dataplane::DataPlane* const data_plane_;
  Metrics* const metrics_;

  common::Mutex open_mu_;  // serializes opening and closing relay channels
  // Lock order: open_mu_, then mu_, then PeerLinks' own.
  mutable common::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool pulling_ ABSL_GUARDED_BY(mu_) = false;                      // a pull is using stubs
  std::map<std::string, Relay> relays_ ABSL_GUARDED_BY(mu_);       // node -> relay channel
  std::map<std::string, std::string> known_ ABSL_GUARDED_BY(mu_);  // node -> address, learned
  std::map<std::string, std::chrono::steady_clock::time_point> dial_failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::peer
