#include "daemon/tls/peer_tls.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace refit::tls {
namespace {

constexpr unsigned kRefreshSeconds = 60;  // how often changed files are reread

std::shared_ptr<grpc::experimental::CertificateProviderInterface> Provider(
    const PeerTlsFiles& files) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, kRefreshSeconds);
}

bool LoopbackAddress(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(address);
    return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
  }
  if (address->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
  }
  return false;
}

// "HOST:PORT" or "[V6]:PORT" -> HOST (no brackets); no colon: the whole text.
std::string HostOf(const std::string& listen) {
  const auto colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

bool IsLoopbackHost(const std::string& bracketed) {
  std::string host = bracketed;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) return false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    loopback = loopback && LoopbackAddress(a->ai_addr);
  }
  freeaddrinfo(found);
  return loopback;
}

absl::Status CheckPeerPlaneExposure(const std::string& listen, const PeerTlsFiles& files,
                                    bool allow_plaintext) {
  if (files.enabled() || allow_plaintext || IsLoopbackHost(HostOf(listen))) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to start: --listen=", listen,
      " is not a loopback address and the peer plane has no TLS, so any host that reaches it "
      "could claim a node name and read every weight held here. Give --tls-cert, --tls-key "
      "and --tls-ca (mutual TLS; docs/security.md), or --listen=127.0.0.1:PORT for daemons on "
      "this host only, or --allow-plaintext-peers on a network where every host is trusted"));
}

absl::StatusOr<PeerTlsFiles> FromCredentials(const std::string& dir) {
  PeerTlsFiles files;
  std::vector<std::string> empty;
  for (const auto& [name, field] : {std::pair<const char*, std::string*>{"tls.crt", &files.cert},
                                    {"tls.key", &files.key},
                                    {"ca.crt", &files.ca}}) {
    const std::string path = absl::StrCat(dir, "/", name);
    std::ifstream in(path);
    std::stringstream text;
    if (in) text << in.rdbuf();
    if (text.str().find("-----BEGIN ") != std::string::npos) {
      *field = path;
    } else {
      empty.push_back(name);
    }
  }
  if (empty.size() == 3) return PeerTlsFiles{};
  if (!empty.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "systemd credentials in ", dir, ": ", absl::StrJoin(empty, ", "),
        " missing or not PEM while the others are given: put all three of tls.crt, tls.key and "
        "ca.crt in /etc/refit/tls/ (the unit's LoadCredential=), or none"));
  }
  return files;
}

absl::Status CheckFiles(const PeerTlsFiles& files) {
  if (files.cert.empty() || files.key.empty() || files.ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-ca go together (mutual TLS needs all three)");
  }
  for (const auto& [flag, path] :
       {std::pair<const char*, const std::string&>{"--tls-cert", files.cert},
        {"--tls-key", files.key},
        {"--tls-ca", files.ca}}) {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
    std::stringstream text;
    text << in.rdbuf();
    if (text.str().find("-----BEGIN ") == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const PeerTlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(Provider(files));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const PeerTlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(files));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);  // the chain, against --tls-ca
  options.set_check_call_host(false);
  options.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

absl::Status CheckIdentity(const grpc::AuthContext& auth, const std::string& node) {
  std::vector<std::string> names;
  for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const grpc::string_ref& value : auth.FindPropertyValues(property)) {
      names.emplace_back(value.data(), value.size());
      if (names.back() == node) return absl::OkStatus();
    }
  }
  if (names.empty()) {
    return absl::PermissionDeniedError("the peer presented no certificate");
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the peer calls itself '", node, "' but its certificate names ", absl::StrJoin(names, ", ")));
}

}  // namespace refit::tls
