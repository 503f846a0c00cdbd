#include "daemon/tls/peer_tls.h"

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

}  // namespace

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
