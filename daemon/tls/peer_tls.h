#pragma once

// Mutual TLS for the peer plane (--tls-cert, --tls-key, --tls-ca): the peer gRPC port and every
// daemon-to-daemon channel. A daemon's identity is its certificate: the node name it gives in
// Hello, Pin, Relay and Report must be the certificate's common name or one of its DNS names.
// Certificates are reread when their files change (cert-manager rotates them in place).
// Without the flags everything is plaintext, and refitd says so at startup.
//
// Thread-safety: the credentials objects are gRPC's (thread-safe); the functions are pure.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace refit::tls {

struct PeerTlsFiles {
  std::string cert;  // PEM: this node's certificate (chain)
  std::string key;   // PEM: its private key
  std::string ca;    // PEM: the CA every peer's certificate must chain to
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// Whether `host` (an IP address or a name, as --listen gives it) is reachable from this host
// only: 127.0.0.0/8, ::1 (bracketed or not), or a name every address of which is one of those. A
// wildcard
// ("", 0.0.0.0, ::), any other address, or a name that does not resolve: false.
bool IsLoopbackHost(const std::string& host);

// Secure by default: FAILED_PRECONDITION, saying how to fix it, when the peer plane would be
// plaintext (no TLS files) on a `listen` (HOST:PORT) that is not a loopback address, unless
// `allow_plaintext` (--allow-plaintext-peers). OK otherwise.
absl::Status CheckPeerPlaneExposure(const std::string& listen, const PeerTlsFiles& files,
                                    bool allow_plaintext);

// systemd credentials: the unit loads /etc/refit/tls/{tls.crt,tls.key,ca.crt} with
// LoadCredential= and SetCredential= defaults ("none"), so $CREDENTIALS_DIRECTORY holds three
// files that are not PEM where the operator put none. The three paths when each is PEM; none
// (TLS off) when no file is; INVALID_ARGUMENT naming the others when only some are.
absl::StatusOr<PeerTlsFiles> FromCredentials(const std::string& dir);

// INVALID_ARGUMENT unless all three are given and readable PEM files.
absl::Status CheckFiles(const PeerTlsFiles& files);

// This daemon's own identity, read at start so that a bad one is a clear error there rather
// than every handshake failing later: INVALID_ARGUMENT naming the file and what to fix when the
// key can't be read (encrypted with a passphrase, not a private key), the key is not the
// certificate's, or the certificate does not chain to the CA or is not valid now (expired, not
// yet valid). `now` (seconds since the epoch; 0: the clock) is for tests.
absl::Status CheckOwnCertificate(const PeerTlsFiles& files, int64_t now = 0);

// FAILED_PRECONDITION when the certificate names neither `node` as its common name nor as a DNS
// name: peers will refuse this node (refitd says so at start and serves its local clients).
absl::Status CheckCertificateNames(const PeerTlsFiles& files, const std::string& node);

// The peer server's credentials: TLS requiring a client certificate that chains to the CA, or
// plaintext without files.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const PeerTlsFiles& files);
// A channel's: TLS presenting this node's certificate and verifying the server's chain (not its
// host name: peers are dialled by address, their identity is checked against Hello), or
// plaintext without files.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const PeerTlsFiles& files);

// OK when `node` is the common name or a DNS name of the peer certificate in `auth`;
// PERMISSION_DENIED otherwise (no certificate: PERMISSION_DENIED too).
absl::Status CheckIdentity(const grpc::AuthContext& auth, const std::string& node);

}  // namespace refit::tls
