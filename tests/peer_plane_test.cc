// The peer plane under attack (issue 37), against the real refitd: fake peers speaking the peer
// protocol on --listen.
//   - Checksum answers only inside a grant: the byte-recovery attack (XXH3 of one-byte ranges
//     as a lookup table) gets PERMISSION_DENIED without a pin, with another reader's or a
//     forged key, for a version it didn't pin, after its pin ends; a real pull still verifies.
//   - Names are bounded (INVALID_ARGUMENT), a Report from a node not subscribed here counts no
//     replica (WaitForReplicas keeps waiting), a Hello in this node's name leaves no attacker
//     text in Status, and memory stays put under many huge reports and subscriptions.
//   - Subscribe streams are bounded per peer (RESOURCE_EXHAUSTED past 128 from one source),
//     the daemon keeps answering; with --tls-* one certificate's streams don't lock out another
//     node, which connects and pulls.
//   - Pins hold at most two versions of a model per source: a fake peer pinning every version
//     under new names doesn't make Publish fail under --max-slot-memory.

#include <dirent.h>
#include <stdlib.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/peer_probe.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using grpc::StatusCode;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::MakeShm;
using testing::PeerProbe;

constexpr uint64_t kBytes = 1 << 20;

void Fill(SharedMemory& shm, uint32_t seed) {
  for (uint64_t i = 0; i < shm.size(); ++i) shm.data()[i] = static_cast<uint8_t>(i * 31 + seed);
}

int ListenPort(client::Client& c) {
  auto s = c.Status();
  REQUIRE(s.ok());
  return s->listen_port();
}

// VmRSS of `pid` in bytes.
uint64_t Rss(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A Subscribe stream held open by the test, as a node that pulls would hold it.
struct HeldStream {
  HeldStream(v1::Peer::Stub* stub, const std::string& node) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::SubscribeRequest request;
    request.set_node(node);
    reader = stub->Subscribe(&context, request);
    v1::PeerEvent event;
    accepted = reader->Read(&event);  // the daemon's state first: every test has a model
    if (!accepted) code = reader->Finish().error_code();
  }
  ~HeldStream() {
    context.TryCancel();
    if (accepted) (void)reader->Finish();
  }
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::PeerEvent>> reader;
  bool accepted = false;
  StatusCode code = StatusCode::OK;
};

int Sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A CA and certificates with CN = the node name (openssl CLI), as tests/tls_test makes them.
struct Pki {
  explicit Pki(const std::vector<std::string>& names) {
    char dir_template[] = "/tmp/refit-peer-pki-XXXXXX";
    REQUIRE(mkdtemp(dir_template));
    dir = dir_template;
    REQUIRE(Sh("cd " + dir +
               " && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ca -keyout ca.key "
               "-out ca.pem") == 0);
    for (const std::string& name : names) {
      REQUIRE(Sh("cd " + dir + " && openssl req -newkey rsa:2048 -nodes -subj /CN=" + name +
                 " -keyout " + name + ".key -out " + name + ".csr && openssl x509 -req -in " +
                 name + ".csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out " + name +
                 ".pem") == 0);
    }
  }
  ~Pki() { std::filesystem::remove_all(dir); }
  std::vector<std::string> Flags(const std::string& name) const {
    return {"--node=" + name, "--tls-cert=" + dir + "/" + name + ".pem",
            "--tls-key=" + dir + "/" + name + ".key", "--tls-ca=" + dir + "/ca.pem"};
  }
  // A peer-port stub presenting `name`'s certificate to the daemon `server` at `port`.
  std::unique_ptr<v1::Peer::Stub> Stub(const std::string& name, const std::string& server,
                                       int port) const {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadFile(dir + "/ca.pem");
    options.pem_private_key = ReadFile(dir + "/" + name + ".key");
    options.pem_cert_chain = ReadFile(dir + "/" + name + ".pem");
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride(server);
    return v1::Peer::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                                       grpc::SslCredentials(options), args));
  }
  std::string dir;
};

v1::ChecksumRequest OneByteRanges(const std::string& piece, uint64_t version, uint64_t count) {
  v1::ChecksumRequest request;
  request.set_model("m");
  request.set_version(version);
  request.set_buffer_id(piece);
  v1::RangeRun* run = request.add_runs();
  run->set_offset(0);
  run->set_length(1);
  run->set_stride(1);
  run->set_count(count);
  return request;
}

}  // namespace

TEST_CASE("Checksum answers only inside a grant; one-byte digests recover nothing",
          "[integration][peer]") {
  auto pair = testing::StartPair({"--node=trainer"}, {"--node=engine"});
  REQUIRE(pair.ok());
  SharedMemory src = MakeShm("plane-src", kBytes), dst = MakeShm("plane-dst", kBytes);
  Fill(src, 1);
  auto s = pair->trainer_client->RegisterBuffer("m", v1::SOURCE, src.name(),
                                                {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  auto d = pair->engine_client->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                               {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE(pair->trainer_client->Publish("m", 1, {*s}).ok());
  REQUIRE(pair->engine_client->WaitForVersion("m", 1, milliseconds(20000)).ok());
  REQUIRE(pair->engine_client->Apply("m", 1, {*d}).ok());
  REQUIRE(std::memcmp(src.data(), dst.data(), kBytes) == 0);

  PeerProbe mallory(ListenPort(*pair->trainer_client));
  v1::ChecksumResponse response;
  // The attack as it was: one-byte ranges, no name, no pin.
  v1::ChecksumRequest attack = OneByteRanges(*s, 1, 4096);
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::INVALID_ARGUMENT);
  attack.set_node("mallory");
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  // Subscribed (it learns its key), still no pin.
  const std::string key = mallory.KeysFor("mallory", "m", 1)[*s];
  REQUIRE_FALSE(key.empty());
  attack.set_remote_key(key);
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  // In the name of the engine, which pins while it pulls: its key is not mallory's.
  attack.set_node("engine");
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  CHECK(response.sums_size() == 0);
  // Pinned, but a forged key, or a version it didn't pin.
  REQUIRE(mallory.Pin("mallory", "m", 1).ok());
  attack.set_node("mallory");
  attack.set_remote_key(std::string(key.size(), 'k'));
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  attack.set_remote_key(key);
  attack.set_version(2);
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  // Inside its grant (a pin it may read through anyway) the digests are right ...
  attack.set_version(1);
  REQUIRE(mallory.Checksum(attack, &response).ok());
  REQUIRE(response.sums_size() == 4096);
  CHECK(response.sums(7) == XXH3_64bits(src.data() + 7, 1));
  // ... and end with it.
  REQUIRE(mallory.Pin("mallory", "m", 1, /*release=*/true).ok());
  response.Clear();
  CHECK(mallory.Checksum(attack, &response).error_code() == StatusCode::PERMISSION_DENIED);
  CHECK(response.sums_size() == 0);

  // The engine still pulls and verifies every byte (its checksums asked inside its pins).
  Fill(src, 2);
  REQUIRE(pair->trainer_client->Publish("m", 2, {*s}).ok());
  REQUIRE(pair->engine_client->WaitForVersion("m", 2, milliseconds(20000)).ok());
  REQUIRE(pair->engine_client->Apply("m", 2, {*d}).ok());
  CHECK(std::memcmp(src.data(), dst.data(), kBytes) == 0);
  CHECK(pair->trainer->running());
}

TEST_CASE("peer names are bounded, fake reports count no replica, Hello leaves no attacker text",
          "[integration][peer]") {
  auto daemon = DaemonProcess::Start({"--node=victim"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  SharedMemory src = MakeShm("plane-names", kBytes);
  Fill(src, 3);
  auto s =
      (*c)->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(s.ok());
  REQUIRE((*c)->Publish("m", 1, {*s}).ok());
  PeerProbe peer(ListenPort(**c));
  v1::Peer::Stub* stub = peer.stub();
  auto call = [](auto&& rpc) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return rpc(&context).error_code();
  };

  {  // names past their bounds
    v1::HelloRequest hello;
    hello.set_node(std::string(256, 'h'));
    v1::HelloResponse hello_response;
    CHECK(call([&](grpc::ClientContext* ctx) {
            return stub->Hello(ctx, hello, &hello_response);
          }) == StatusCode::INVALID_ARGUMENT);
    HeldStream huge(stub, std::string(1 << 20, 's'));
    CHECK_FALSE(huge.accepted);
    CHECK(huge.code == StatusCode::INVALID_ARGUMENT);
    CHECK(peer.Pin("n", std::string(2048, 'm'), 1).error_code() == StatusCode::INVALID_ARGUMENT);
    CHECK(peer.Pin(std::string(300, 'n'), "m", 1).error_code() == StatusCode::INVALID_ARGUMENT);
  }

  auto report = [&](const std::string& node, uint64_t version) {
    v1::ReplicaReport r;
    r.set_node(node);
    r.set_relay(true);
    auto* m = r.add_models();
    m->set_model("m");
    m->set_latest_version(version);
    v1::ReplicaReportResponse response;
    return call([&](grpc::ClientContext* ctx) { return stub->Report(ctx, r, &response); });
  };
  // A node that isn't subscribed here is nobody: refused, and WaitForReplicas doesn't count it.
  CHECK(report("ghost", 1) == StatusCode::FAILED_PRECONDITION);
  auto waited = (*c)->WaitForReplicas("m", 1, 1, milliseconds(1500));
  CHECK(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  auto model = testing::ModelStatusOf(**c, "m");
  REQUIRE(model.ok());
  CHECK(model->replicas_size() == 0);
  {
    // Subscribed, it may report what it holds (not versions never published here).
    HeldStream subscribed(stub, "replica");
    REQUIRE(subscribed.accepted);
    CHECK(report("replica", 1000) == StatusCode::INVALID_ARGUMENT);
    CHECK(report("replica", 1) == StatusCode::OK);
    auto counted = (*c)->WaitForReplicas("m", 1, 1, milliseconds(5000));
    REQUIRE(counted.ok());
  }

  {  // a Hello in the victim's own name, with a hostile --listen
    v1::HelloRequest hello;
    hello.set_node("victim");
    hello.set_instance("someone-else");
    hello.set_listen("\x1b[2J\r\nFAKE LOG LINE " + std::string(1000, 'A'));
    v1::HelloResponse hello_response;
    CHECK(call([&](grpc::ClientContext* ctx) {
            return stub->Hello(ctx, hello, &hello_response);
          }) == StatusCode::FAILED_PRECONDITION);
    auto status = (*c)->Status();
    REQUIRE(status.ok());
    bool shown = false;
    for (const v1::PeerStatus& p : status->pulled_by()) {
      if (p.error().empty()) continue;
      shown = true;
      INFO(p.error());
      CHECK(p.error().size() < 400);
      CHECK(p.address().size() < 100);
      for (char ch : p.error() + p.address()) CHECK(static_cast<unsigned char>(ch) >= 0x20);
      CHECK(p.error().find("FAKE LOG LINE") != std::string::npos);  // escaped, shortened
    }
    CHECK(shown);
  }

  // Memory: reports naming new nodes with 1,000 models of 1 KiB each, reports from a subscribed
  // node past the byte bound, subscriptions with 1 MiB names. Nothing is kept.
  const uint64_t before = Rss((*daemon)->pid());
  {
    HeldStream subscribed(stub, "big");
    REQUIRE(subscribed.accepted);
    for (int i = 0; i < 120; ++i) {
      v1::ReplicaReport r;
      r.set_node(i % 2 ? "big" : "node-" + std::to_string(i));
      for (int k = 0; k < 1000; ++k) {
        auto* m = r.add_models();
        m->set_model(std::to_string(i) + "-" + std::to_string(k) + std::string(1000, 'x'));
      }
      v1::ReplicaReportResponse response;
      const StatusCode code =
          call([&](grpc::ClientContext* ctx) { return stub->Report(ctx, r, &response); });
      INFO("report " << i);
      CHECK(code == (i % 2 ? StatusCode::INVALID_ARGUMENT : StatusCode::FAILED_PRECONDITION));
    }
    for (int i = 0; i < 30; ++i) {
      HeldStream huge(stub, std::string(1 << 20, static_cast<char>('a' + i % 26)));
      CHECK(huge.code == StatusCode::INVALID_ARGUMENT);
    }
  }
  const uint64_t after = Rss((*daemon)->pid());
  INFO("RSS " << before << " -> " << after);
  CHECK(after < before + (48ull << 20));
  REQUIRE((*daemon)->running());
  Fill(src, 4);
  CHECK((*c)->Publish("m", 2, {*s}).ok());
}

TEST_CASE("Subscribe streams are bounded per peer; the daemon answers on", "[integration][peer]") {
  auto daemon = DaemonProcess::Start({"--node=victim"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  SharedMemory src = MakeShm("plane-streams", kBytes);
  Fill(src, 5);
  auto s =
      (*c)->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(s.ok());
  REQUIRE((*c)->Publish("m", 1, {*s}).ok());
  PeerProbe peer(ListenPort(**c));
  std::vector<std::unique_ptr<HeldStream>> held;
  int accepted = 0, exhausted = 0;
  for (int i = 0; i < 160; ++i) {
    held.push_back(std::make_unique<HeldStream>(peer.stub(), "idle-" + std::to_string(i)));
    if (held.back()->accepted) {
      ++accepted;
    } else if (held.back()->code == StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
    }
  }
  CHECK(accepted == 128);
  CHECK(exhausted == 32);
  // Everything else still answers, at once.
  const auto start = std::chrono::steady_clock::now();
  CHECK(peer.Pin("reader", "m", 1).ok());
  v1::HelloRequest hello;
  hello.set_node("reader");
  v1::HelloResponse response;
  grpc::ClientContext context;
  CHECK(peer.stub()->Hello(&context, hello, &response).ok());
  CHECK((*c)->Status().ok());
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  held.clear();
  // Their places come back once they end.
  std::this_thread::sleep_for(milliseconds(500));
  HeldStream again(peer.stub(), "later");
  CHECK(again.accepted);
}

TEST_CASE("pins hold at most two versions of a model per source: Publish keeps fitting",
          "[integration][peer]") {
  // One version is 1 MiB; --retain=1 keeps one, Publish needs one more, and one source's pins
  // may keep one more past --retain: 3 MiB. A fake peer pins every version under a new name.
  // Deltas off: the delta encoder would hold the previous version too.
  auto daemon = DaemonProcess::Start(
      {"--node=victim", "--retain=1", "--max-slot-memory=3MiB", "--delta-threshold=0"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  SharedMemory src = MakeShm("plane-pins", kBytes);
  auto s =
      (*c)->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(s.ok());
  PeerProbe peer(ListenPort(**c));
  for (uint64_t v = 1; v <= 12; ++v) {
    INFO("version " << v);
    Fill(src, static_cast<uint32_t>(v));
    // A pin let go frees its slot once the data plane's next sweep deregisters it (within
    // ~1 s): a Publish right after may wait for that, never for a lease.
    auto published = (*c)->Publish("m", v, {*s});
    for (int retry = 0; !published.ok() && retry < 60; ++retry) {
      std::this_thread::sleep_for(milliseconds(50));
      published = (*c)->Publish("m", v, {*s});
    }
    INFO(published.status().ToString());
    REQUIRE(published.ok());
    CHECK(peer.Pin("pinner-" + std::to_string(v), "m", v, false, 300000).ok());
  }
  REQUIRE((*daemon)->running());
}

TEST_CASE("with --tls-*, one certificate's idle streams don't lock out another node",
          "[integration][peer][tls]") {
  if (Sh("command -v openssl") != 0) FAIL("openssl is needed to make the test's certificates");
  Pki pki({"trainer", "engine", "mallory"});
  auto trainer = DaemonProcess::Start(pki.Flags("trainer"));
  REQUIRE(trainer.ok());
  auto c = (*trainer)->Connect();
  REQUIRE(c.ok());
  SharedMemory src = MakeShm("plane-tls-src", kBytes), dst = MakeShm("plane-tls-dst", kBytes);
  Fill(src, 7);
  auto s =
      (*c)->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(s.ok());
  REQUIRE((*c)->Publish("m", 1, {*s}).ok());
  const int port = ListenPort(**c);
  // Mallory, a certificate of the fleet, holds every stream its source may (and claims other
  // names in vain: they must be its certificate's).
  auto mallory = pki.Stub("mallory", "trainer", port);
  std::vector<std::unique_ptr<HeldStream>> held;
  int accepted = 0, exhausted = 0;
  for (int i = 0; i < 150; ++i) {
    held.push_back(std::make_unique<HeldStream>(mallory.get(), "mallory"));
    accepted += held.back()->accepted;
    exhausted += held.back()->code == StatusCode::RESOURCE_EXHAUSTED;
  }
  CHECK(accepted == 128);
  CHECK(exhausted == 22);
  HeldStream impostor(mallory.get(), "engine");
  CHECK(impostor.code == StatusCode::PERMISSION_DENIED);
  // The engine, from the same host, connects and pulls.
  std::vector<std::string> flags = pki.Flags("engine");
  flags.push_back("--peers=127.0.0.1:" + std::to_string(port));
  auto engine = DaemonProcess::Start(flags);
  REQUIRE(engine.ok());
  auto e = (*engine)->Connect();
  REQUIRE(e.ok());
  auto d = (*e)->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                {Slice("w", v1::UINT8, {int64_t{kBytes}})});
  REQUIRE(d.ok());
  REQUIRE((*e)->WaitForVersion("m", 1, milliseconds(30000)).ok());
  REQUIRE((*e)->Apply("m", 1, {*d}).ok());
  CHECK(std::memcmp(src.data(), dst.data(), kBytes) == 0);

  // Checksums with TLS: a certificate of the fleet reads nothing of a version it didn't pin,
  // and can't ask in another node's name.
  held.clear();
  std::this_thread::sleep_for(milliseconds(500));
  std::string key;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SubscribeRequest request;
    request.set_node("mallory");
    auto reader = mallory->Subscribe(&context, request);
    v1::PeerEvent event;
    while (reader->Read(&event) && (event.version() != 1 || event.pieces_size() == 0)) {
    }
    REQUIRE(event.pieces_size() == 1);
    key = event.pieces(0).remote_key();
    context.TryCancel();
    (void)reader->Finish();
  }
  auto checksum = [&](const std::string& node) {
    v1::ChecksumRequest request = OneByteRanges(*s, 1, 4096);
    request.set_node(node);
    request.set_remote_key(key);
    v1::ChecksumResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const StatusCode code = mallory->Checksum(&context, request, &response).error_code();
    if (code != StatusCode::OK) CHECK(response.sums_size() == 0);
    return code;
  };
  CHECK(checksum("mallory") == StatusCode::PERMISSION_DENIED);  // no pin
  CHECK(checksum("engine") == StatusCode::PERMISSION_DENIED);   // not its certificate
  {
    v1::PinRequest pin;
    pin.set_model("m");
    pin.set_version(1);
    pin.set_node("engine");
    v1::PinResponse response;
    grpc::ClientContext context;
    CHECK(mallory->Pin(&context, pin, &response).error_code() == StatusCode::PERMISSION_DENIED);
  }
  CHECK(checksum("engine") == StatusCode::PERMISSION_DENIED);
}

}  // namespace refit
