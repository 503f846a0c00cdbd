#include "daemon/peer/peer_dial.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "daemon/version.h"

namespace refit::peer {

namespace {
constexpr auto kHelloDeadline = std::chrono::milliseconds(2000);
}  // namespace

std::chrono::system_clock::time_point DeadlineIn(std::chrono::milliseconds ms) {
  return std::chrono::system_clock::now() + ms;
}

std::string TrustFailure(const grpc::Status& status, bool tls, const std::string& address) {
  const std::string& message = status.error_message();
  auto has = [&message](const char* text) { return message.find(text) != std::string::npos; };
  if (status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    return absl::StrCat("peer at ", address, " refused: ", message);
  }
  if (tls && (has("andshake failed") || has("SSL_ERROR") || has("certificate"))) {
    return absl::StrCat(
        "peer at ", address, ": no mutual TLS session (", message,
        "): each side's certificate must be valid now and issued by the CA the other side "
        "trusts (--tls-ca), and the peer must run with --tls-* too");
  }
  if (!tls && has("Socket closed")) {
    return absl::StrCat("peer at ", address, " closed the connection before answering (", message,
                        "): a peer with mutual TLS (--tls-*) does that to plaintext; if it "
                        "runs with --tls-*, give this node --tls-cert, --tls-key and --tls-ca");
  }
  return "";
}

grpc::Status Dialer::Dial(const std::string& address, Dialed* out) const {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, tls::ChannelCredentials(tls_), args);
  auto stub = v1::Peer::NewStub(channel);
  v1::HelloRequest hello;
  hello.set_node(node_);
  hello.set_version(kRefitVersion);
  hello.set_instance(instance_);
  hello.set_listen(listen_);
  v1::HelloResponse who;
  grpc::ClientContext hello_context;
  hello_context.set_deadline(DeadlineIn(kHelloDeadline));
  grpc::Status status = stub->Hello(&hello_context, hello, &who);
  if (status.ok() && (who.node().empty() || who.node().size() > 255)) {
    // Pieces without a node are this node's own: such a peer's versions would look complete
    // here without a byte pulled.
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("it names itself '", who.node().substr(0, 64),
                                       "' (a node name is 1 to 255 bytes)"));
  }
  if (status.ok() && tls_.enabled()) {
    // Its identity is its certificate: a peer may not call itself another node.
    if (auto auth = hello_context.auth_context(); auth) {
      absl::Status identity = tls::CheckIdentity(*auth, who.node());
      if (!identity.ok()) {
        status = grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(identity.message()));
      }
    }
  }
  out->who = std::move(who);
  out->channel = std::move(channel);
  out->stub = std::move(stub);
  return status;
}

}  // namespace refit::peer
