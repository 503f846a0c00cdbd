// What a new user gets wrong on the first day, against real daemons (issue 19): two daemons
// with one --node name, version numbers reused after a restart, a misspelled model, an engine
// that registers first with the wrong shape, and `refitctl drop`.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/ports.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::ClientOf;
using testing::DaemonProcess;
using testing::FreePort;
using testing::MakeShm;
using testing::StartDaemon;

int ListenPort(const DaemonProcess& d) {
  auto s = ClientOf(d)->Status();
  REQUIRE(s.ok());
  return s->listen_port();
}

// Polls `client`'s Status (up to 10 s) until `ready` holds.
template <typename Ready>
v1::StatusResponse WaitForStatus(client::Client& client, Ready ready, const char* what) {
  for (int i = 0; i < 200; ++i) {
    auto s = client.Status();
    REQUIRE(s.ok());
    if (ready(*s)) return *s;
    std::this_thread::sleep_for(milliseconds(50));
  }
  FAIL("timed out waiting for " << what);
  return {};
}

const v1::ModelStatus* ModelIn(const v1::StatusResponse& s, const std::string& model) {
  for (const auto& m : s.models()) {
    if (m.model() == model) return &m;
  }
  return nullptr;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("a peer with this node's --node name is refused, naming both addresses",
          "[integration][first_hour]") {
  auto first = StartDaemon({"--node=same"});
  const std::string first_address = "127.0.0.1:" + std::to_string(ListenPort(*first));
  // The second one also lists itself, as a headless Service resolving to every daemon would.
  const int own_port = FreePort();
  const std::string own_address = "127.0.0.1:" + std::to_string(own_port);
  auto second = StartDaemon(
      {"--node=same", "--listen=" + own_address, "--peers=" + first_address + "," + own_address});
  auto client = ClientOf(*second);
  const auto status = WaitForStatus(
      *client,
      [](const v1::StatusResponse& s) {
        return s.peers_size() == 1 && !s.peers(0).error().empty();
      },
      "the refusal");
  // Only the other daemon is listed: this daemon itself is skipped quietly.
  const v1::PeerStatus& peer = status.peers(0);
  CHECK(peer.address() == first_address);
  CHECK_FALSE(peer.connected());
  CHECK(Contains(peer.error(), "--node=same"));
  CHECK(Contains(peer.error(), first_address));
  CHECK(Contains(peer.error(), own_address));
  // The refused side shows who tried, too.
  auto first_client = ClientOf(*first);
  const auto seen = WaitForStatus(
      *first_client, [](const v1::StatusResponse& s) { return s.pulled_by_size() == 1; },
      "the refused caller");
  CHECK(Contains(seen.pulled_by(0).error(), own_address));
  CHECK(seen.peers_size() == 0);
  // refitctl status says it in words.
  auto shown = testing::RunCommand(
      {testing::RunfilePath("client/refitctl"), "--socket=" + second->socket(), "status"});
  CHECK(shown.exit_code == 0);
  CHECK(Contains(shown.out, "refused"));
  CHECK(Contains(shown.out, "give each refitd its own --node"));
}

TEST_CASE("with --state-dir a restarted trainer's node refuses version numbers already used",
          "[integration][first_hour]") {
  char dir_template[] = "/tmp/refit-state-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string state = dir_template;
  SharedMemory src = MakeShm("fh", 4096);
  auto run = [&](uint64_t from, uint64_t to) {
    auto node = StartDaemon({"--node=trainer", "--state-dir=" + state});
    auto trainer = ClientOf(*node);
    auto id = trainer->RegisterBuffer("llama", v1::SOURCE, src.name(),
                                      {Slice("w", v1::FP32, {1024})}, "trainer");
    REQUIRE(id.ok());
    for (uint64_t v = from; v <= to; ++v) REQUIRE(trainer->Publish("llama", v, {*id}).ok());
    return std::make_pair(std::move(node), std::move(trainer));
  };
  { run(1, 3); }  // stopped at the end of the scope
  auto [node, trainer] = run(1, 0);
  auto id = trainer->RegisterBuffer("llama", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                    "trainer-2");
  REQUIRE(id.ok());
  for (uint64_t reused : {1, 3}) {
    auto refused = trainer->Publish("llama", reused, {*id});
    REQUIRE(refused.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(Contains(std::string(refused.status().message()),
                   "newest published for it on this node is 3"));
    CHECK(Contains(std::string(refused.status().message()), state + "/state.json"));
  }
  CHECK(trainer->Publish("llama", 4, {*id}).ok());

  // A damaged state file stops refitd at startup with a message saying what to do.
  { std::ofstream(state + "/state.json") << "{\"format\": \"refit-state\", \"models\": 7}"; }
  auto damaged = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=t2",
                                      "--socket=" + state + "/t2.sock", "--listen=127.0.0.1:0",
                                      "--state-dir=" + state});
  CHECK(damaged.exit_code == 1);
  CHECK(Contains(damaged.err, "is not a valid refit state file"));
  CHECK(Contains(damaged.err, "move it away"));
}

TEST_CASE("an engine's node skips reused numbers from a restarted trainer's node, and says so",
          "[integration][first_hour]") {
  const int port = FreePort();
  const std::string trainer_listen = "--listen=127.0.0.1:" + std::to_string(port);
  SharedMemory src = MakeShm("fh", 4096);
  SharedMemory dst = MakeShm("fh", 4096);
  auto trainer_node = StartDaemon({"--node=trainer", trainer_listen});
  auto engine_node = StartDaemon({"--node=engine", "--peers=127.0.0.1:" + std::to_string(port)});
  auto engine = ClientOf(*engine_node);
  auto d = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(), {Slice("w", v1::FP32, {1024})},
                                  "engine");
  REQUIRE(d.ok());
  {
    auto trainer = ClientOf(*trainer_node);
    auto s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                     "trainer");
    REQUIRE(s.ok());
    for (uint64_t v = 1; v <= 3; ++v) REQUIRE(trainer->Publish("m", v, {*s}).ok());
    REQUIRE(engine->WaitForVersion("m", 3, milliseconds(20000)).ok());
  }
  REQUIRE(trainer_node->Stop(SIGTERM) == 0);
  trainer_node = StartDaemon({"--node=trainer", trainer_listen});  // no --state-dir: fresh
  auto trainer = ClientOf(*trainer_node);
  auto s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                   "trainer");
  REQUIRE(s.ok());
  REQUIRE(trainer->Publish("m", 2, {*s}).ok());
  const auto status = WaitForStatus(
      *engine,
      [](const v1::StatusResponse& st) {
        const auto* m = ModelIn(st, "m");
        return m && m->skipped_version() == 2;
      },
      "the skipped version");
  const auto* m = ModelIn(status, "m");
  CHECK(m->latest_version() == 3);
  CHECK(Contains(m->skipped_reason(), "numbers were reused"));
  CHECK(Contains(m->skipped_reason(), "--state-dir"));
  auto shown = testing::RunCommand({testing::RunfilePath("client/refitctl"),
                                    "--socket=" + engine_node->socket(), "versions", "m"});
  CHECK(Contains(shown.out, "skipped: version 2"));
  // A number above the engine's goes through.
  REQUIRE(trainer->Publish("m", 4, {*s}).ok());
  auto got = engine->WaitForVersion("m", 4, milliseconds(20000));
  REQUIRE(got.ok());
  CHECK(*got == 4);
}

TEST_CASE("waiting on a model no node has sources for says so and names the nearest",
          "[integration][first_hour]") {
  auto nodes = testing::StartPair({"--node=trainer"}, {"--node=engine"});
  REQUIRE(nodes.ok());
  std::unique_ptr<client::Client>& trainer = nodes->trainer_client;
  std::unique_ptr<client::Client>& engine = nodes->engine_client;
  SharedMemory src = MakeShm("fh", 4096);
  SharedMemory dst = MakeShm("fh", 4096);
  auto s = trainer->RegisterBuffer("llama", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                   "trainer");
  REQUIRE(s.ok());
  WaitForStatus(
      *engine, [](const v1::StatusResponse& st) { return ModelIn(st, "llama"); },
      "the trainer's model");
  auto d = engine->RegisterBuffer("lama", v1::DESTINATION, dst.name(),
                                  {Slice("w", v1::FP32, {1024})}, "engine");
  REQUIRE(d.ok());
  const auto started = std::chrono::steady_clock::now();
  auto waited = engine->WaitForVersion("lama", 1, milliseconds(300));
  CHECK(std::chrono::steady_clock::now() - started < milliseconds(5000));
  REQUIRE(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  const std::string message(waited.status().message());
  CHECK(Contains(message, "no node has SOURCE buffers for lama"));
  CHECK(Contains(message, "known models: llama"));
  CHECK(Contains(message, "did you mean 'llama'?"));
  // refitctl watch and versions both refuse an unknown name, with the nearest one.
  auto watch = testing::RunCommand({testing::RunfilePath("client/refitctl"),
                                    "--socket=" + nodes->engine->socket(), "watch", "llma"});
  CHECK(watch.exit_code == 1);
  CHECK(Contains(watch.err, "model llma is not known"));
  CHECK(Contains(watch.err, "did you mean"));
  auto versions = testing::RunCommand({testing::RunfilePath("client/refitctl"),
                                       "--socket=" + nodes->engine->socket(), "versions", "llma"});
  CHECK(versions.exit_code == 1);
  CHECK(Contains(versions.err, "model llma is not known"));
  // Once the engine lets go of its buffer, the misspelled model is gone from Status.
  REQUIRE(engine->ReleaseBuffer(*d).ok());
  auto after = engine->Status();
  REQUIRE(after.ok());
  CHECK(ModelIn(*after, "lama") == nullptr);
  CHECK(ModelIn(*after, "llama") != nullptr);
}

TEST_CASE("refitctl drop releases a model's versions once no buffer of it is left",
          "[integration][first_hour]") {
  char dir_template[] = "/tmp/refit-state-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  auto node = StartDaemon({"--node=trainer", std::string("--state-dir=") + dir_template});
  auto trainer = ClientOf(*node);
  SharedMemory src = MakeShm("fh", 4096);
  auto s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                   "trainer-rank0");
  REQUIRE(s.ok());
  for (uint64_t v = 1; v <= 3; ++v) REQUIRE(trainer->Publish("m", v, {*s}).ok());
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto busy = testing::RunCommand({refitctl, "--socket=" + node->socket(), "drop", "m"});
  CHECK(busy.exit_code == 1);
  CHECK(Contains(busy.err, *s));
  CHECK(Contains(busy.err, "trainer-rank0"));
  auto kept = trainer->Status();
  REQUIRE(kept.ok());
  REQUIRE(ModelIn(*kept, "m"));
  CHECK(ModelIn(*kept, "m")->versions_size() == 2);  // nothing changed
  auto unknown = testing::RunCommand({refitctl, "--socket=" + node->socket(), "drop", "n"});
  CHECK(unknown.exit_code == 1);
  CHECK(Contains(unknown.err, "not known"));

  REQUIRE(trainer->ReleaseBuffer(*s).ok());
  auto still = trainer->Status();
  REQUIRE(still.ok());
  CHECK(ModelIn(*still, "m") != nullptr);  // versions stay held until dropped
  auto dropped =
      testing::RunCommand({refitctl, "--socket=" + node->socket(), "--json", "drop", "m"});
  CHECK(dropped.exit_code == 0);
  CHECK(Contains(dropped.out, "\"forgotten_version\": 3"));
  CHECK(Contains(dropped.out, "\"released_versions\": [\n    2,\n    3\n  ]"));
  auto gone = trainer->Status();
  REQUIRE(gone.ok());
  CHECK(ModelIn(*gone, "m") == nullptr);
  CHECK(gone->metrics().at("refit_slot_memory_bytes") >= 0);
  // A new run starts again at 1.
  s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                              "trainer-rank0");
  REQUIRE(s.ok());
  CHECK(trainer->Publish("m", 1, {*s}).ok());
}

TEST_CASE("the sources' layout wins over a destination that registered first",
          "[integration][first_hour]") {
  auto nodes = testing::StartPair({"--node=trainer"}, {"--node=engine"});
  REQUIRE(nodes.ok());
  std::unique_ptr<client::Client>& trainer = nodes->trainer_client;
  std::unique_ptr<client::Client>& engine = nodes->engine_client;
  SharedMemory src = MakeShm("fh", 4096);
  SharedMemory wrong = MakeShm("fh", 8192);
  SharedMemory right = MakeShm("fh", 4096);
  // The engine comes first, with a wrong shape; the trainer's registration still succeeds.
  auto bad = engine->RegisterBuffer("m", v1::DESTINATION, wrong.name(),
                                    {Slice("w", v1::FP32, {2048})}, "engine-wrong");
  REQUIRE(bad.ok());
  auto s = trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::FP32, {1024})},
                                   "trainer-rank0");
  REQUIRE(s.ok());
  const auto status = WaitForStatus(
      *engine,
      [](const v1::StatusResponse& st) {
        const auto* m = ModelIn(st, "m");
        return m && m->buffers_size() == 1 && !m->buffers(0).error().empty();
      },
      "the refused destination");
  const std::string error = ModelIn(status, "m")->buffers(0).error();
  CHECK(Contains(error, *bad));
  CHECK(Contains(error, "engine-wrong"));
  CHECK(Contains(error, "[2048] disagrees with [1024]"));
  CHECK(Contains(error, *s));
  CHECK(Contains(error, "on node trainer"));
  // A destination that agrees with the sources is served; the refused one is told why.
  auto good = engine->RegisterBuffer("m", v1::DESTINATION, right.name(),
                                     {Slice("w", v1::FP32, {1024})}, "engine-right");
  REQUIRE(good.ok());
  for (int i = 0; i < 1024; ++i) reinterpret_cast<float*>(src.data())[i] = float(i);
  REQUIRE(trainer->Publish("m", 1, {*s}).ok());
  REQUIRE(engine->WaitForVersion("m", 1, milliseconds(20000)).ok());
  REQUIRE(engine->Apply("m", 1, {*good}).ok());
  CHECK(std::memcmp(right.data(), src.data(), 4096) == 0);
  auto refused = engine->Apply("m", 1, {*bad});
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(std::string(refused.status().message()), "engine-wrong"));
  // A wrong destination registering after the sources are known is refused at once.
  auto late = engine->RegisterBuffer("m", v1::DESTINATION, wrong.name(),
                                     {Slice("w", v1::FP32, {2048})}, "engine-late");
  CHECK(late.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(std::string(late.status().message()), *s));
}

TEST_CASE("a source disagreeing with another names the buffer and client that came first",
          "[integration][first_hour]") {
  auto node = StartDaemon({"--node=one"});
  auto c = ClientOf(*node);
  SharedMemory a = MakeShm("fh", 4096);
  SharedMemory b = MakeShm("fh", 8192);
  SharedMemory d = MakeShm("fh", 8192);
  auto dst =
      c->RegisterBuffer("m", v1::DESTINATION, d.name(), {Slice("w", v1::FP32, {2048})}, "engine");
  REQUIRE(dst.ok());
  auto first =
      c->RegisterBuffer("m", v1::SOURCE, a.name(), {Slice("w", v1::FP32, {1024})}, "rank0");
  REQUIRE(first.ok());
  auto second =
      c->RegisterBuffer("m", v1::SOURCE, b.name(), {Slice("w", v1::FP32, {2048})}, "rank1");
  REQUIRE(second.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string message(second.status().message());
  CHECK(Contains(message, *first));
  CHECK(Contains(message, "client rank0"));
  // The destination that came before the sources is the one refused, on this node too.
  auto status = c->Status();
  REQUIRE(status.ok());
  const auto* m = ModelIn(*status, "m");
  REQUIRE(m);
  bool refused = false;
  for (const auto& buffer : m->buffers()) {
    if (buffer.buffer_id() == *dst) refused = Contains(buffer.error(), "client rank0");
  }
  CHECK(refused);
}

}  // namespace
}  // namespace refit
