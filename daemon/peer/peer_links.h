#pragma once

// The --peers connections: one loop per address (Dial, then a Subscribe stream whose events
// PeerEvents applies here), reconnecting with backoff; a peer that turns out to be this very
// daemon (a name resolving to every daemon) is left alone, one with this node's name is refused.
// Other parts of the peer plane look connected peers up here: RelayChannels (a connected peer
// is used before a relay channel), the replica reporter and ForwardHold.
//
// Thread-safety: every method may be called from any thread. Add may be called after Stop
// (it does nothing then).

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_dial.h"
#include "daemon/peer/peer_events.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

struct PeerState {
  std::string address;
  std::string node;  // empty until the first Hello
  bool connected = false;
  std::string error;  // why this daemon does not connect to it (e.g. it has this node's name)
};

class PeerLinks {
 public:
  // Nothing is owned.
  PeerLinks(const Dialer* dialer, PeerEvents* events, dataplane::DataPlane* data_plane,
            Metrics* metrics);
  ~PeerLinks();  // Stop() and Join()

  // Starts a connection loop for `address` unless one runs for it already, or after Stop.
  void Add(const std::string& address);
  // Cancels the streams, drops the peers' data-plane endpoints (a pull in flight fails) and
  // wakes the loops; Join waits for them.
  void Stop();
  void Join();

  std::vector<PeerState> Peers() const;
  // The stub of connected node `node`, or null. A stub replaced by a reconnect stays valid
  // until ClearRetired.
  v1::Peer::Stub* Connected(const std::string& node) const;
  // The same, shared (for calls made outside any pull: reports, holds).
  std::shared_ptr<v1::Peer::Stub> ConnectedShared(const std::string& node) const;
  // Every connected peer's node and stub.
  std::vector<std::pair<std::string, std::shared_ptr<v1::Peer::Stub>>> AllConnected() const;
  size_t ConnectedCount() const;
  // Whether some --peers address answered as `node` (connected now or not).
  bool Has(const std::string& node) const;
  // `node`'s --site as its Hello said, when some --peers address answered as `node`.
  std::optional<std::string> SiteOf(const std::string& node) const;
  // Frees the stubs reconnects replaced; only while no pull holds a stub (RelayChannels).
  void ClearRetired();

 private:
  struct Link;
  void Run(Link* link);
  // Waits `delay` or until Stop; false once stopped.
  bool Sleep(std::chrono::milliseconds delay);

  const Dialer* const dialer_;
  PeerEvents* const events_;
  dataplane::DataPlane* const data_plane_;
  Metrics* const metrics_;

  mutable common::Mutex mu_;
  common::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);  // grows only
  // Stubs of connections replaced by a reconnect while a pull may still hold them (Connected
  // hands out plain pointers): kept until ClearRetired.
  std::vector<std::shared_ptr<v1::Peer::Stub>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::peer
