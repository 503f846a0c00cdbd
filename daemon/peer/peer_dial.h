#pragma once

// Opening a control channel to another daemon (PeerLinks' --peers connections and
// RelayChannels' relay channels): a gRPC channel with keepalives, and its Hello, checked (a node
// name of 1 to 255 bytes; with mutual TLS, the name its certificate carries).
//
// Thread-safety: Dial may be called from any thread; SetListen before the first Dial.

#include <memory>
#include <string>

#include "daemon/tls/peer_tls.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

struct Dialed {
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<v1::Peer::Stub> stub;
  v1::HelloResponse who;
};

class Dialer {
 public:
  // `node`: this node; `instance`: this daemon's random per-process id (its Hello's).
  Dialer(std::string node, std::string instance, tls::PeerTlsFiles tls)
      : node_(std::move(node)), instance_(std::move(instance)), tls_(std::move(tls)) {}

  // This daemon's --listen address as bound (told in each Hello); before the first Dial.
  void SetListen(const std::string& listen) { listen_ = listen; }
  const std::string& listen() const { return listen_; }
  const std::string& node() const { return node_; }
  const std::string& instance() const { return instance_; }
  bool tls() const { return tls_.enabled(); }

  // A channel to `address` and its Hello, checked. `out` is filled also on failure (the
  // answer, when there was one).
  grpc::Status Dial(const std::string& address, Dialed* out) const;

 private:
  const std::string node_;
  const std::string instance_;
  const tls::PeerTlsFiles tls_;
  std::string listen_;
};

// What a failed Dial says about trust, for the operator ("" when it was not about trust): a
// TLS handshake that failed (a certificate expired, of another CA, refused by the peer), a
// peer whose certificate names another node, or (this node without TLS) a connection the peer
// closed before answering, as a peer with --tls-* does to plaintext.
std::string TrustFailure(const grpc::Status& status, bool tls, const std::string& address);

// A system_clock deadline `ms` milliseconds from now (gRPC contexts).
std::chrono::system_clock::time_point DeadlineIn(std::chrono::milliseconds ms);

}  // namespace refit::peer
