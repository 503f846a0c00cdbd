#pragma once

// --peers names, resolved: every address a name resolves to gets a connection loop (PeerLinks),
// at Start and then every 10 s (a DaemonSet scaling up behind a headless Kubernetes Service
// resolves to more daemons later).
//
// Thread-safety: Start and Stop from the owner; Stop is idempotent.

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/peer/peer_links.h"

namespace refit::peer {

// "host:port" -> every "ip:port" the name resolves to now (one entry, unchanged, when it
// doesn't resolve). A headless Kubernetes Service resolves to every daemon.
std::vector<std::string> ResolvePeerAddress(const std::string& address);

class PeerResolver {
 public:
  // `links` is not owned. `every`: how often the names are resolved again.
  PeerResolver(std::vector<std::string> configured, PeerLinks* links,
               std::chrono::milliseconds every = std::chrono::seconds(10))
      : configured_(std::move(configured)), links_(links), every_(every) {}
  ~PeerResolver() { Stop(); }

  // Resolves every name once (on the caller's thread), then again every `every` on its own.
  void Start();
  void Stop();

 private:
  void ResolveAll();
  void Run();

  const std::vector<std::string> configured_;  // --peers as given
  PeerLinks* const links_;
  const std::chrono::milliseconds every_;
  common::Mutex mu_;
  common::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::peer
