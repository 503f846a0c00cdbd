// Secure by default: which --listen addresses count as loopback, and when a plaintext peer plane
// stops the start (the refitd process is held to it by deploy/tests/refitd_config_smoke_test).

#include "daemon/tls/peer_tls.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "catch2/catch.hpp"

namespace refit::tls {
namespace {

TEST_CASE("loopback hosts: 127/8, ::1, localhost; not wildcards or other addresses", "[tls]") {
  CHECK(IsLoopbackHost("127.0.0.1"));
  CHECK(IsLoopbackHost("127.3.4.5"));
  CHECK(IsLoopbackHost("::1"));
  CHECK(IsLoopbackHost("[::1]"));
  CHECK(IsLoopbackHost("::ffff:127.0.0.1"));
  CHECK(IsLoopbackHost("localhost"));
  CHECK_FALSE(IsLoopbackHost(""));
  CHECK_FALSE(IsLoopbackHost("0.0.0.0"));
  CHECK_FALSE(IsLoopbackHost("::"));
  CHECK_FALSE(IsLoopbackHost("10.0.0.1"));
  CHECK_FALSE(IsLoopbackHost("192.0.2.1"));
  CHECK_FALSE(IsLoopbackHost("::ffff:10.0.0.1"));
  CHECK_FALSE(IsLoopbackHost("fe80::1"));
  CHECK_FALSE(IsLoopbackHost("no-such-host.invalid"));
}

TEST_CASE("plaintext on a non-loopback --listen is refused unless allowed or TLS is on", "[tls]") {
  const PeerTlsFiles none;
  const PeerTlsFiles files{"/etc/refit/tls/tls.crt", "/etc/refit/tls/tls.key",
                           "/etc/refit/tls/ca.crt"};
  for (const char* listen : {"0.0.0.0:7070", "[::]:7070", ":7070", "10.0.0.1:7070"}) {
    INFO(listen);
    const absl::Status refused = CheckPeerPlaneExposure(listen, none, false);
    CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
    // The message says how to fix it.
    CHECK_THAT(std::string(refused.message()),
               Catch::Contains("--tls-cert") && Catch::Contains("--allow-plaintext-peers") &&
                   Catch::Contains("127.0.0.1") && Catch::Contains(listen));
    CHECK(CheckPeerPlaneExposure(listen, none, true).ok());
    CHECK(CheckPeerPlaneExposure(listen, files, false).ok());
  }
  for (const char* listen : {"127.0.0.1:7070", "127.0.0.1:0", "[::1]:7070", "localhost:7070"}) {
    INFO(listen);
    CHECK(CheckPeerPlaneExposure(listen, none, false).ok());
  }
}

TEST_CASE("systemd credentials: all three files, none, or an error naming the missing", "[tls]") {
  char dir_template[] = "/tmp/refit-credentials-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
  };
  // The unit's SetCredential= defaults: no TLS.
  for (const char* name : {"tls.crt", "tls.key", "ca.crt"}) write(name, "none");
  auto none = FromCredentials(dir);
  REQUIRE(none.ok());
  CHECK_FALSE(none->enabled());
  // A missing directory: no TLS either.
  auto missing = FromCredentials(dir + "/nowhere");
  REQUIRE(missing.ok());
  CHECK_FALSE(missing->enabled());
  // Two of three: refused, naming the one missing.
  write("tls.crt", "-----BEGIN CERTIFICATE-----\n");
  write("tls.key", "-----BEGIN PRIVATE KEY-----\n");
  auto partial = FromCredentials(dir);
  CHECK(partial.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(partial.status().message()),
             Catch::Contains("ca.crt missing or not PEM") && Catch::Contains("/etc/refit/tls/"));
  write("ca.crt", "-----BEGIN CERTIFICATE-----\n");
  auto all = FromCredentials(dir);
  REQUIRE(all.ok());
  CHECK(all->cert == dir + "/tls.crt");
  CHECK(all->key == dir + "/tls.key");
  CHECK(all->ca == dir + "/ca.crt");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::tls
