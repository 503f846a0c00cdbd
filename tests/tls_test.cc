// Mutual TLS on the peer plane, with certificates this test makes (openssl CLI): a good pair
// syncs bit-exact; a peer whose certificate is from another CA, expired, missing, or names
// another node, and a plaintext client, are all refused (issue 17).

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;

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

int ListenPort(DaemonProcess& d) {
  auto s = d.Connect().value()->Status();
  REQUIRE(s.ok());
  return s->listen_port();
}

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
    "mutual TLS: a good pair syncs; other CAs, expired, missing or misnamed "
    "certificates and plaintext are refused",
    "[integration][trust]") {
  if (Sh("command -v openssl") != 0) FAIL("openssl is needed to make the test's certificates");
  Pki pki;
  auto flags = pki.Flags("trainer");
  flags.push_back("--node=trainer");
  auto t = DaemonProcess::Start(flags);
  REQUIRE(t.ok());
  auto trainer_node = std::move(t).value();
  const int port = ListenPort(*trainer_node);
  auto trainer = trainer_node->Connect().value();

  // The good pair. Its engine lives to the end: UCX 1.13 can abort the trainer's process when a
  // peer's endpoint fails while UCX is still wiring it up (ucp_request.c assertion), so no
  // engine is stopped while the trainer runs.
  auto good_engine = Engine(port, pki.Flags("engine"));
  {
    auto& engine_node = good_engine;
    auto engine = engine_node->Connect().value();
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
  SECTION("a certificate from another CA") {
    auto engine_node = Engine(port, pki.Flags("stranger", "ca"), "stranger");
    REQUIRE_FALSE(Connects(*engine_node->Connect().value(), milliseconds(3000)));
  }
  SECTION("an expired certificate") {
    auto engine_node = Engine(port, pki.Flags("old"), "old");
    REQUIRE_FALSE(Connects(*engine_node->Connect().value(), milliseconds(3000)));
  }
  SECTION("no certificate: a plaintext daemon") {
    auto engine_node = Engine(port, {}, "plain");
    REQUIRE_FALSE(Connects(*engine_node->Connect().value(), milliseconds(3000)));
  }
  SECTION("a good certificate under another node's name") {
    auto engine_node = Engine(port, pki.Flags("engine"), "trainer2");
    REQUIRE_FALSE(Connects(*engine_node->Connect().value(), milliseconds(3000)));
  }
  SECTION("a plaintext client on the peer port") {
    auto stub = v1::Peer::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                      grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + milliseconds(3000));
    v1::HelloRequest hello;
    hello.set_node("plain");
    v1::HelloResponse response;
    REQUIRE_FALSE(stub->Hello(&context, hello, &response).ok());
    auto insight = v1::PeerInsight::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext timeline_context;
    timeline_context.set_deadline(std::chrono::system_clock::now() + milliseconds(3000));
    v1::PeerTimelineRequest request;
    request.set_model("m");
    v1::PeerTimelineResponse timeline;
    REQUIRE_FALSE(insight->Timeline(&timeline_context, request, &timeline).ok());
  }
  REQUIRE(trainer_node->running());
  trainer_node->Stop(SIGTERM);
}

}  // namespace refit
