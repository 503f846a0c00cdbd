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
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "openssl/x509v3.h"

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

namespace {

// OpenSSL's most recent error, for a message ("" when it has none).
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();  // NOLINT(runtime/int): OpenSSL's type
  ERR_clear_error();
  if (code == 0) return "";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
struct StoreFree {
  void operator()(X509_STORE* store) const { X509_STORE_free(store); }
};
struct StoreContextFree {
  void operator()(X509_STORE_CTX* context) const { X509_STORE_CTX_free(context); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * stack) const { sk_X509_pop_free(stack, X509_free); }
};
using Bio = std::unique_ptr<BIO, BioFree>;

// A passphrase callback that has none to give: an encrypted key fails to load.
int NoPassphrase(char* /*buffer*/, int /*size*/, int /*rwflag*/, void* /*user*/) { return 0; }

// Every certificate of a PEM file, in order.
std::vector<std::unique_ptr<X509, X509Free>> ReadCertificates(const std::string& path) {
  std::vector<std::unique_ptr<X509, X509Free>> out;
  Bio bio(BIO_new_file(path.c_str(), "r"));
  if (!bio) return out;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr)) {
    out.emplace_back(cert);
  }
  ERR_clear_error();  // the end of the file reads as an error
  return out;
}

// The certificate's common names and DNS names.
std::vector<std::string> NamesOf(X509* cert) {
  std::vector<std::string> names;
  X509_NAME* subject = X509_get_subject_name(cert);
  for (int i = X509_NAME_get_index_by_NID(subject, NID_commonName, -1); i >= 0;
       i = X509_NAME_get_index_by_NID(subject, NID_commonName, i)) {
    const ASN1_STRING* value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i));
    names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                       static_cast<size_t>(ASN1_STRING_length(value)));
  }
  auto* alternatives =
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (alternatives) {
    for (int i = 0; i < sk_GENERAL_NAME_num(alternatives); ++i) {
      const GENERAL_NAME* name = sk_GENERAL_NAME_value(alternatives, i);
      if (name->type != GEN_DNS) continue;
      names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(name->d.dNSName)),
                         static_cast<size_t>(ASN1_STRING_length(name->d.dNSName)));
    }
    GENERAL_NAMES_free(alternatives);
  }
  return names;
}

}  // namespace

absl::Status CheckOwnCertificate(const PeerTlsFiles& files, int64_t now) {
  ERR_clear_error();
  EVP_PKEY* raw_key = nullptr;
  {
    Bio bio(BIO_new_file(files.key.c_str(), "r"));
    if (bio) raw_key = PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr);
  }
  std::unique_ptr<EVP_PKEY, KeyFree> key(raw_key);
  if (!key) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: cannot read a private key from ", files.key, " (", OpenSslError(),
        "): refitd needs the key unencrypted, in PEM (a key protected by a passphrase can't be "
        "read at start; `openssl pkey -in KEY -out KEY.plain` removes it)"));
  }
  auto chain = ReadCertificates(files.cert);
  if (chain.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: ", files.cert, " holds no PEM certificate"));
  }
  X509* cert = chain.front().get();
  if (X509_check_private_key(cert, key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", files.key, " is not the key of the certificate in ", files.cert,
                     " (the key of another certificate?)"));
  }
  auto roots = ReadCertificates(files.ca);
  if (roots.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-ca: ", files.ca, " holds no PEM certificate"));
  }
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (auto& root : roots) X509_STORE_add_cert(store.get(), root.get());
  std::unique_ptr<STACK_OF(X509), StackFree> intermediates(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) {
    X509_up_ref(chain[i].get());
    sk_X509_push(intermediates.get(), chain[i].get());
  }
  std::unique_ptr<X509_STORE_CTX, StoreContextFree> context(X509_STORE_CTX_new());
  if (!store || !intermediates || !context ||
      X509_STORE_CTX_init(context.get(), store.get(), cert, intermediates.get()) != 1) {
    return absl::InternalError(absl::StrCat("checking --tls-cert: ", OpenSslError()));
  }
  if (now > 0) X509_STORE_CTX_set_time(context.get(), 0, static_cast<time_t>(now));
  if (X509_verify_cert(context.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(context.get());
    ERR_clear_error();
    std::string fix = "a certificate issued by the CA of --tls-ca";
    if (error == X509_V_ERR_CERT_HAS_EXPIRED) {
      fix = "a renewed certificate (cert-manager renews it before it expires; check its Issuer)";
    } else if (error == X509_V_ERR_CERT_NOT_YET_VALID) {
      fix = "a certificate valid now, or this host's clock set right";
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: ", files.cert, " is not valid against --tls-ca=", files.ca, ": ",
                     X509_verify_cert_error_string(error), "; peers would refuse it. Give ", fix));
  }
  return absl::OkStatus();
}

absl::Status CheckCertificateNames(const PeerTlsFiles& files, const std::string& node) {
  auto chain = ReadCertificates(files.cert);
  if (chain.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: ", files.cert, " holds no PEM certificate"));
  }
  const std::vector<std::string> names = NamesOf(chain.front().get());
  for (const std::string& name : names) {
    if (name == node) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--tls-cert: ", files.cert, " names ", names.empty() ? "no one" : absl::StrJoin(names, ", "),
      ", not this node (--node=", node,
      "): peers check that a node's certificate names it and will refuse this one. Give the "
      "certificate issued for this node, or the --node it names"));
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
