#include "daemon/peer/peer_links.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/peer/peer_metrics.h"

namespace refit::peer {
namespace {

using std::chrono::milliseconds;

constexpr auto kMaxBackoff = milliseconds(2000);

}  // namespace

struct PeerLinks::Link {
  std::string address;
  std::string node;
  std::string site;        // its Hello's --site; guarded by PeerLinks::mu_
  bool connected = false;  // guarded by PeerLinks::mu_
  std::string error;       // guarded by PeerLinks::mu_
  // Why the last Dial failed when it was a matter of trust (TLS, identity), for Status;
  // guarded by PeerLinks::mu_.
  std::string refused;
  // Set by its thread before `node`, under mu_; shared with the replica reporter, which calls
  // through it outside the lock while a reconnect may replace it.
  std::shared_ptr<v1::Peer::Stub> stub;
  std::shared_ptr<grpc::Channel> channel;
  grpc::ClientContext* stream = nullptr;  // the live Subscribe call, for Stop
  std::thread thread;
};

PeerLinks::PeerLinks(const Dialer* dialer, PeerEvents* events, dataplane::DataPlane* data_plane,
                     Metrics* metrics)
    : dialer_(dialer), events_(events), data_plane_(data_plane), metrics_(metrics) {
  metrics_->Declare(kPeersConnected);
}

PeerLinks::~PeerLinks() {
  Stop();
  Join();
}

void PeerLinks::Add(const std::string& address) {
  common::MutexLock lock(mu_);
  if (stop_) return;
  for (const auto& link : links_) {
    if (link->address == address) return;
  }
  auto link = std::make_unique<Link>();
  link->address = address;
  Link* l = link.get();
  links_.push_back(std::move(link));
  l->thread = std::thread([this, l] { Run(l); });
}

void PeerLinks::Stop() {
  {
    common::MutexLock lock(mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& link : links_) {
      if (link->stream) link->stream->TryCancel();
      // Dropping the endpoint cancels a pull in flight, so the pull worker can finish.
      if (!link->node.empty()) data_plane_->Disconnect(link->node);
    }
  }
  wake_.NotifyAll();
}

void PeerLinks::Join() {
  std::vector<Link*> joining;  // links_ no longer grows: stop_ is set
  {
    common::MutexLock lock(mu_);
    for (auto& link : links_) joining.push_back(link.get());
  }
  for (Link* link : joining) {
    if (link->thread.joinable()) link->thread.join();
  }
}

bool PeerLinks::Sleep(milliseconds delay) {
  common::UniqueLock lock(mu_);
  wake_.WaitFor(lock, delay, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
  return !stop_;
}

std::vector<PeerState> PeerLinks::Peers() const {
  const std::string& self = dialer_->node();
  common::MutexLock lock(mu_);
  std::vector<PeerState> out;
  for (const auto& link : links_) {
    if (link->node == self + " (self)") continue;
    // A refused peer has this node's name (kept out of `node`, which names endpoints).
    out.push_back({link->address, link->error.empty() ? link->node : self, link->connected,
                   link->error.empty() ? link->refused : link->error});
  }
  return out;
}

v1::Peer::Stub* PeerLinks::Connected(const std::string& node) const {
  common::MutexLock lock(mu_);
  for (const auto& link : links_) {
    if (link->node == node && link->connected) return link->stub.get();
  }
  return nullptr;
}

std::shared_ptr<v1::Peer::Stub> PeerLinks::ConnectedShared(const std::string& node) const {
  common::MutexLock lock(mu_);
  std::shared_ptr<v1::Peer::Stub> stub;
  for (const auto& link : links_) {
    if (link->node == node && link->connected && link->stub) stub = link->stub;
  }
  return stub;
}

std::vector<std::pair<std::string, std::shared_ptr<v1::Peer::Stub>>> PeerLinks::AllConnected()
    const {
  std::vector<std::pair<std::string, std::shared_ptr<v1::Peer::Stub>>> out;
  common::MutexLock lock(mu_);
  for (const auto& link : links_) {
    if (link->connected && link->stub) out.emplace_back(link->node, link->stub);
  }
  return out;
}

size_t PeerLinks::ConnectedCount() const {
  common::MutexLock lock(mu_);
  size_t open = 0;
  for (const auto& link : links_) open += link->connected ? 1 : 0;
  return open;
}

bool PeerLinks::Has(const std::string& node) const {
  common::MutexLock lock(mu_);
  for (const auto& link : links_) {
    if (link->node == node) return true;
  }
  return false;
}

std::optional<std::string> PeerLinks::SiteOf(const std::string& node) const {
  common::MutexLock lock(mu_);
  for (const auto& link : links_) {
    if (link->node == node) return link->site;
  }
  return std::nullopt;
}

void PeerLinks::ClearRetired() {
  common::MutexLock lock(mu_);
  retired_.clear();
}

void PeerLinks::Run(Link* link) {
  const std::string& self = dialer_->node();
  auto backoff = milliseconds(100);
  bool reported_down = false;
  while (true) {
    {
      common::MutexLock lock(mu_);
      if (stop_) return;
    }
    Dialed dialed;
    grpc::Status status = dialer_->Dial(link->address, &dialed);
    const v1::HelloResponse& who = dialed.who;
    if (status.ok() && who.node() == self &&
        (who.instance() == dialer_->instance() || who.instance().empty())) {
      // A name that resolves to every daemon (a headless Service) includes this one.
      Logger("peer")->info("peer at {} is this node; not connecting to it", link->address);
      common::MutexLock lock(mu_);
      link->node = self + " (self)";
      return;
    }
    if (status.ok() && who.node() == self) {
      // Another daemon with this node's name: its pieces would pass for this node's own.
      status = grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat(
              "two daemons have --node=", self, ": the one at ", link->address,
              who.listen().empty() ? "" : absl::StrCat(" (listening on ", who.listen(), ")"),
              " and this one at ", dialer_->listen(),
              "; node names must be unique: give each refitd its own --node"));
    }
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
        status.error_message().rfind("two daemons have --node=", 0) == 0) {
      bool first = false;
      {
        common::MutexLock lock(mu_);
        first = link->error != status.error_message();
        link->error = status.error_message();
        link->node.clear();
      }
      if (first) Logger("peer")->warn("peer at {} refused: {}", link->address, link->error);
      if (!Sleep(kMaxBackoff)) return;
      continue;  // the operator may restart it under another name
    }
    if (status.ok()) {
      backoff = milliseconds(100);
      reported_down = false;
      const std::string node = who.node();
      if (!who.transport_address().empty()) data_plane_->Connect(node, who.transport_address());
      grpc::ClientContext context;
      context.set_deadline(DeadlineIn(milliseconds(24ll * 3600 * 1000)));
      {
        common::MutexLock lock(mu_);
        if (stop_) return;
        link->node = node;
        link->site = who.site().size() <= kMaxNodeName ? who.site() : "";
        link->connected = true;
        link->error.clear();
        link->refused.clear();
        link->channel = dialed.channel;
        if (link->stub) retired_.push_back(std::move(link->stub));
        link->stub = std::move(dialed.stub);
        link->stream = &context;
      }
      metrics_->Add(kPeersConnected, 1);
      metrics_->Add(kPeerChannelsOpen, 1);
      Logger("peer")->info("peer={} connected at {} (refitd {}, data plane {})", Printable(node),
                           link->address, Printable(who.version()), Printable(who.transport()));
      v1::SubscribeRequest request;
      request.set_node(self);
      request.set_listen(dialer_->listen());
      auto reader = link->stub->Subscribe(&context, request);
      v1::PeerEvent event;
      while (reader->Read(&event)) {
        if (!events_->Apply(node, event).ok()) {
          // The peer is dropped as if it had failed (its layout so far stays, and its versions
          // are forgotten), and reconnected with backoff.
          context.TryCancel();
          break;
        }
      }
      status = reader->Finish();
      {
        common::MutexLock lock(mu_);
        link->connected = false;
        link->stream = nullptr;
      }
      metrics_->Add(kPeersConnected, -1);
      metrics_->Add(kPeerChannelsOpen, -1);
      events_->Forget(node);
      data_plane_->Disconnect(node);
      Logger("peer")->warn(
          "peer={} at {} disconnected: {}", node, link->address,
          status.error_message().empty() ? "stream ended" : status.error_message());
    } else if (std::string why = TrustFailure(status, dialer_->tls(), link->address);
               !why.empty()) {
      // Refused for trust (certificates, identity): said in Status, logged once per reason.
      bool first = false;
      {
        common::MutexLock lock(mu_);
        first = link->refused != why;
        link->refused = why;
      }
      if (first) Logger("peer")->error("{}; retrying", why);
      reported_down = true;
    } else if (!reported_down) {
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        Logger("peer")->error("peer at {} refused: {}; retrying", link->address,
                              status.error_message());
      } else {
        Logger("peer")->warn("peer at {} not answering ({}); retrying", link->address,
                             status.error_message());
      }
      reported_down = true;
    }
    if (!Sleep(backoff)) return;
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace refit::peer
