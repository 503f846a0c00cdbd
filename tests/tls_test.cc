// Mutual TLS on the peer plane, with certificates this test makes (openssl CLI): a good pair
// syncs bit-exact; a peer whose certificate is from another CA, expired, missing, or names
// another node, and a plaintext client, are all refused (issue 17), each with a clear error,
// while the daemon keeps serving its local clients and its good peer (issue 33); a daemon whose
// own certificate or key is bad refuses to start, saying why.

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/two_nodes.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::ListenPort;

int Sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

// A CA, a second CA, and certificates: trainer and engine (good), stranger (other CA),
// old (expired), all with CN = the node name.
struct Pki {
  Pki() {
    char dir_template[] = "/tmp/refit-pki-XXXXXX";
    REQUIRE(mkdtemp(dir_template));
    dir = dir_template;
    for (const std::string ca : {"ca", "other-ca"}) {
      REQUIRE(Sh("cd " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=" +
                 ca + " -keyout " + ca + ".key -out " + ca + ".pem") == 0);
    }
    Issue("trainer", "ca", "");
    Issue("engine", "ca", "");
    Issue("stranger", "other-ca", "");
    Issue("old", "ca", "expired");
    // The engine's key under a passphrase: a key refitd cannot read.
    REQUIRE(Sh("cd " + dir +
               " && openssl pkey -in engine.key -aes256 -passout pass:secret -out locked.key") ==
            0);
  }
  ~Pki() { std::filesystem::remove_all(dir); }
  void Issue(const std::string& name, const std::string& ca, const std::string& expired) {
    REQUIRE(Sh("cd " + dir + " && openssl req -newkey rsa:2048 -nodes -subj /CN=" + name +
               " -keyout " + name + ".key -out " + name + ".csr") == 0);
    if (expired.empty()) {
      REQUIRE(Sh("cd " + dir + " && openssl x509 -req -in " + name + ".csr -CA " + ca +
                 ".pem -CAkey " + ca + ".key -CAcreateserial -days 2 -out " + name + ".pem") == 0);
      return;
    }
    // An expired certificate: `openssl ca` takes explicit start and end dates.
    std::ofstream conf(dir + "/ca.cnf");
    conf << "[ca]\ndefault_ca=d\n[d]\ndatabase=" << dir << "/index.txt\nserial=" << dir
         << "/serial\nnew_certs_dir=" << dir
         << "\ndefault_md=sha256\npolicy=p\n[p]\ncommonName="
            "supplied\n";
    conf.close();
    std::ofstream(dir + "/index.txt").close();
    std::ofstream(dir + "/serial") << "1000\n";
    REQUIRE(Sh("cd " + dir + " && openssl ca -batch -config ca.cnf -cert " + ca + ".pem -keyfile " +
               ca + ".key -startdate 20200101000000Z -enddate 20200102000000Z -in " + name +
               ".csr -out " + name + ".pem") == 0);
  }
  std::vector<std::string> Flags(const std::string& name, const std::string& ca = "ca") const {
    return {"--tls-cert=" + dir + "/" + name + ".pem", "--tls-key=" + dir + "/" + name + ".key",
            "--tls-ca=" + dir + "/" + ca + ".pem"};
  }
  std::string dir;
};

// Whether `engine`'s daemon gets its peer connected within `wait`.
bool Connects(client::Client& engine, milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  while (std::chrono::steady_clock::now() < until) {
    auto s = engine.Status();
    REQUIRE(s.ok());
    for (const auto& p : s->peers()) {
      if (p.connected()) return true;
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  return false;
}

// The error `engine`'s daemon gives for its (only) peer in Status, once it has one (up to 10 s).
std::string PeerError(client::Client& engine) {
  const auto until = std::chrono::steady_clock::now() + milliseconds(10000);
  while (std::chrono::steady_clock::now() < until) {
    auto s = engine.Status();
    REQUIRE(s.ok());
    for (const auto& p : s->peers()) {
      if (!p.error().empty()) return p.error();
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  return "";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A peer-plane client of the test's own presenting `name`'s certificate (none: `name` empty),
// trusting `ca`; the trainer's certificate names "trainer", not the address dialled.
std::unique_ptr<v1::Peer::Stub> TlsPeer(const Pki& pki, int port, const std::string& name,
                                        const std::string& ca = "ca") {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ReadFile(pki.dir + "/" + ca + ".pem");
  if (!name.empty()) {
    options.pem_private_key = ReadFile(pki.dir + "/" + name + ".key");
    options.pem_cert_chain = ReadFile(pki.dir + "/" + name + ".pem");
  }
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("trainer");
  return v1::Peer::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                                     grpc::SslCredentials(options), args));
}

grpc::Status Hello(v1::Peer::Stub& stub, const std::string& node) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + milliseconds(5000));
  v1::HelloRequest hello;
  hello.set_node(node);
  v1::HelloResponse response;
  return stub.Hello(&context, hello, &response);
}

std::unique_ptr<DaemonProcess> Engine(int trainer_port, std::vector<std::string> flags,
                                      const std::string& node = "engine") {
  flags.push_back("--node=" + node);
  flags.push_back("--peers=127.0.0.1:" + std::to_string(trainer_port));
  auto d = DaemonProcess::Start(flags);
  REQUIRE(d.ok());
  return std::move(d).value();
}

}  // namespace

TEST_CASE(
    "mutual TLS: a good pair syncs; other CAs, expired, missing or misnamed certificates and "
    "plaintext are refused, each clearly, while the daemon serves the rest",
    "[integration][trust]") {
  if (Sh("command -v openssl") != 0) FAIL("openssl is needed to make the test's certificates");
  Pki pki;
  auto flags = pki.Flags("trainer");
  flags.push_back("--node=trainer");
  // The trainer's log, for what it says about refused handshakes.
  const std::string log = pki.dir + "/trainer.log";
  auto t = DaemonProcess::Start(flags, "", {}, {"/bin/sh", "-c", "exec \"$@\" 2>>" + log, "sh"});
  REQUIRE(t.ok());
  auto trainer_node = std::move(t).value();
  const int port = ListenPort(*trainer_node);
  auto trainer = trainer_node->Connect().value();

  // The good pair. Its engine lives to the end: UCX 1.13 can abort the trainer's process when a
  // peer's endpoint fails while UCX is still wiring it up (ucp_request.c assertion), so no
  // engine is stopped while the trainer runs.
  auto good_engine = Engine(port, pki.Flags("engine"));
  auto engine = good_engine->Connect().value();
  REQUIRE(Connects(*engine, milliseconds(10000)));
  auto src = SharedMemory::Create(testing::UniqueShmName("tls-src"), 1 << 20).value();
  auto dst = SharedMemory::Create(testing::UniqueShmName("tls-dst"), 1 << 20).value();
  for (uint64_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<uint8_t>(i * 7 + 3);
  auto s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(),
                                   {Slice("w", v1::BF16, {512, 1024}, 0)}, "trainer");
  auto d = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                  {Slice("w", v1::BF16, {512, 1024}, 0)}, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE(trainer->Publish("m", 1, {*s}).ok());
  REQUIRE(engine->WaitForVersion("m", 1, milliseconds(20000)).ok());
  REQUIRE(engine->Apply("m", 1, {*d}).ok());
  REQUIRE(std::memcmp(src.data(), dst.data(), src.size()) == 0);
  {
    // The timeline is gathered over the same mutual TLS (refit.v1.PeerInsight), each answer
    // checked against its certificate's name.
    auto timeline = engine->Timeline("m", 1);
    REQUIRE(timeline.ok());
    INFO(timeline->DebugString());
    REQUIRE(timeline->nodes_size() == 2);
    REQUIRE(timeline->nodes(1).node() == "trainer");
    REQUIRE(timeline->nodes(1).error().empty());
    REQUIRE(timeline->nodes(1).versions_size() == 1);
  }
  // The test's own TLS client is accepted with a good certificate (the control for the
  // refusals below).
  REQUIRE(Hello(*TlsPeer(pki, port, "engine"), "engine").ok());

  SECTION("a daemon of another CA") {
    auto engine_node = Engine(port, pki.Flags("stranger", "other-ca"), "stranger");
    auto stranger = engine_node->Connect().value();
    REQUIRE_FALSE(Connects(*stranger, milliseconds(3000)));
    const std::string error = PeerError(*stranger);
    INFO(error);
    CHECK(error.find("no mutual TLS session") != std::string::npos);
    CHECK(error.find("certificate verify failed") != std::string::npos);
  }
  SECTION("a peer presenting a certificate of another CA") {
    CHECK(Hello(*TlsPeer(pki, port, "stranger"), "stranger").error_code() ==
          grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("a peer presenting an expired certificate") {
    CHECK(Hello(*TlsPeer(pki, port, "old"), "old").error_code() == grpc::StatusCode::UNAVAILABLE);
    // Said on the trainer's side once, in refit's words.
    const auto until = std::chrono::steady_clock::now() + milliseconds(5000);
    while (ReadFile(log).find("a certificate was refused") == std::string::npos &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(50));
    }
    CHECK(ReadFile(log).find("TLS handshake failed on a peer connection: a certificate was "
                             "refused") != std::string::npos);
  }
  SECTION("a peer presenting no certificate") {
    CHECK(Hello(*TlsPeer(pki, port, ""), "anyone").error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("a good certificate under another node's name") {
    auto stub = TlsPeer(pki, port, "engine");
    const grpc::Status hello = Hello(*stub, "trainer2");
    CHECK(hello.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(hello.error_message() ==
          "the peer calls itself 'trainer2' but its certificate names engine");
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + milliseconds(5000));
    v1::PinRequest pin;
    pin.set_model("m");
    pin.set_version(1);
    pin.set_node("trainer2");
    v1::PinResponse pinned;
    CHECK(stub->Pin(&context, pin, &pinned).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  SECTION("no certificate: a plaintext daemon") {
    auto engine_node = Engine(port, {}, "plain");
    auto plain = engine_node->Connect().value();
    REQUIRE_FALSE(Connects(*plain, milliseconds(3000)));
    const std::string error = PeerError(*plain);
    INFO(error);
    CHECK(error.find("closed the connection before answering") != std::string::npos);
    CHECK(error.find("give this node --tls-cert, --tls-key and --tls-ca") != std::string::npos);
    const auto until = std::chrono::steady_clock::now() + milliseconds(5000);
    while (ReadFile(log).find("a peer without TLS (plaintext)") == std::string::npos &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(50));
    }
    const std::string said = ReadFile(log);
    CHECK(said.find("TLS handshake failed on a peer connection: a peer without TLS (plaintext) "
                    "dialled the peer port") != std::string::npos);
    // Once, not a line per attempt (the plaintext daemon retries several times a second).
    size_t lines = 0;
    for (size_t at = said.find("a peer without TLS"); at != std::string::npos;
         at = said.find("a peer without TLS", at + 1)) {
      ++lines;
    }
    CHECK(lines == 1);
  }
  SECTION("a plaintext client on the peer port") {
    auto stub = v1::Peer::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                      grpc::InsecureChannelCredentials()));
    CHECK_FALSE(Hello(*stub, "plain").ok());
    auto insight = v1::PeerInsight::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext timeline_context;
    timeline_context.set_deadline(std::chrono::system_clock::now() + milliseconds(3000));
    v1::PeerTimelineRequest request;
    request.set_model("m");
    v1::PeerTimelineResponse timeline;
    CHECK_FALSE(insight->Timeline(&timeline_context, request, &timeline).ok());
  }

  // Whatever was refused, the trainer serves its local client and its good peer: the next
  // version reaches the engine bit-exact.
  REQUIRE(trainer_node->running());
  for (uint64_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<uint8_t>(i * 11 + 5);
  REQUIRE(trainer->Publish("m", 2, {*s}).ok());
  REQUIRE(engine->WaitForVersion("m", 2, milliseconds(20000)).ok());
  REQUIRE(engine->Apply("m", 2, {*d}).ok());
  REQUIRE(std::memcmp(src.data(), dst.data(), src.size()) == 0);
  REQUIRE(trainer->Status().ok());
  trainer_node->Stop(SIGTERM);
}

TEST_CASE("a daemon whose own key or certificate is bad refuses to start, saying why",
          "[integration][trust]") {
  if (Sh("command -v openssl") != 0) FAIL("openssl is needed to make the test's certificates");
  Pki pki;
  struct Case {
    std::string cert, key, ca, node, says;
  };
  const std::string d = pki.dir + "/";
  const std::vector<Case> cases = {
      {"engine.pem", "locked.key", "ca.pem", "engine", "--tls-key: cannot read a private key"},
      {"engine.pem", "trainer.key", "ca.pem", "engine", "is not the key of the certificate"},
      {"old.pem", "old.key", "ca.pem", "old", "certificate has expired"},
      {"stranger.pem", "stranger.key", "ca.pem", "stranger", "unable to get local issuer"},
  };
  for (const Case& c : cases) {
    const std::string socket = d + c.node + ".sock";
    auto run = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=" + c.node,
                                    "--socket=" + socket, "--listen=127.0.0.1:0",
                                    "--tls-cert=" + d + c.cert, "--tls-key=" + d + c.key,
                                    "--tls-ca=" + d + c.ca});
    INFO(c.cert << " " << c.key << " --node=" << c.node << ": " << run.err);
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("cannot start") != std::string::npos);
    CHECK(run.err.find(c.says) != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(socket));
  }
  // A certificate naming another node: said at start; the daemon serves its local clients
  // (peers refuse it, as the first test case's misnamed peer).
  const std::string log = d + "misnamed.log";
  auto misnamed =
      DaemonProcess::Start({"--node=trainer2", "--tls-cert=" + d + "engine.pem",
                            "--tls-key=" + d + "engine.key", "--tls-ca=" + d + "ca.pem"},
                           "", {}, {"/bin/sh", "-c", "exec \"$@\" 2>>" + log, "sh"});
  REQUIRE(misnamed.ok());
  REQUIRE((*misnamed)->Connect().value()->Status().ok());
  CHECK(ReadFile(log).find("names engine, not this node (--node=trainer2): peers check") !=
        std::string::npos);
}

}  // namespace refit
