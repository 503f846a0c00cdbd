// One trainer's node and several engine nodes (refitd processes on this machine): engine nodes
// relay each version to each other stripe by stripe, so the trainer's node sends each version
// about once; every engine still gets it bit-exact, verified against the trainer's checksums,
// whichever node its bytes came from — also when a relay serves wrong bytes or dies
// mid-transfer. Replica status and WaitForReplicas say which nodes hold which version.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/fleet.h"
#include "tests/testing/real_model.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::Fill;
using testing::Fleet;
using testing::Metric;

std::string At(int port) { return "127.0.0.1:" + std::to_string(port); }

// A loopback fleet: one bf16 tensor [rows, 4096]; engine i holds all of it, or (half[i]) its
// second half of rows, as a TP2 rank would.
testing::FleetOptions Loopback(int engines, int64_t rows, std::vector<bool> half = {},
                               std::vector<std::vector<std::string>> engine_args = {},
                               std::vector<std::vector<std::string>> engine_env = {}) {
  testing::FleetOptions options;
  options.engines = engines;
  options.rows = rows;
  options.half = std::move(half);
  options.engine_args = std::move(engine_args);
  options.engine_env = std::move(engine_env);
  return options;
}

}  // namespace

TEST_CASE("four engine nodes relay each version: the trainer's node sends it about once",
          "[integration][fanout]") {
  Fleet fleet(Loopback(4, 8192));  // 64 MiB
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 3; ++v) {
    const double sent_before = Metric(*fleet.trainer, "refit_data_bytes_sent_total");
    const double relayed_before = fleet.RelaySent();
    fleet.PublishAndCheck(v);
    // The pins' releases (where the bytes are counted) follow completion by a moment.
    std::this_thread::sleep_for(milliseconds(300));
    const double sent = Metric(*fleet.trainer, "refit_data_bytes_sent_total") - sent_before;
    const double relayed = fleet.RelaySent() - relayed_before;
    INFO("version " << v << ": trainer sent " << sent / model << " models, relays "
                    << relayed / model);
    REQUIRE(sent <= 1.1 * model);
    REQUIRE(sent >= 0.9 * model);
    REQUIRE(relayed >= 2.5 * model);  // 3/4 of the model to each of 4 nodes
  }
  // Replicas: the trainer knows every engine and its version; WaitForReplicas answers at once
  // for what is there and past its deadline (naming who is behind) for what is not.
  auto status = fleet.trainer->Status();
  REQUIRE(status.ok());
  REQUIRE(status->models_size() == 1);
  REQUIRE(status->models(0).replicas_size() == 4);
  for (const auto& r : status->models(0).replicas()) {
    REQUIRE(r.latest_version() == 3);
    REQUIRE(r.relay());
  }
  auto all = fleet.trainer->WaitForReplicas("m", 3, 0, milliseconds(5000));
  REQUIRE(all.ok());
  REQUIRE(all->version() == 3);
  REQUIRE(all->nodes_size() == 4);
  const auto asked = std::chrono::steady_clock::now();
  auto later = fleet.trainer->WaitForReplicas("m", 4, 1, milliseconds(500));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
  REQUIRE(later.status().code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(waited >= 0.45);
  REQUIRE(waited < 3.0);
  auto more = fleet.trainer->WaitForReplicas("m", 3, 5, milliseconds(300));
  REQUIRE(more.status().code() == absl::StatusCode::kDeadlineExceeded);
  // A quorum: the next version, waited for by 2 of 4 while it is on its way.
  Fill(*fleet.source, 4 * 7919);
  REQUIRE(fleet.trainer->Publish("m", 4, {fleet.source_id}).ok());
  auto quorum = fleet.trainer->WaitForReplicas("m", 4, 2, milliseconds(30000));
  REQUIRE(quorum.ok());
  REQUIRE(quorum->nodes_size() >= 2);
  fleet.CheckEngines(4);
}

TEST_CASE("engines of different layouts share relays; each gets exactly its bytes",
          "[integration][fanout]") {
  Fleet fleet(Loopback(4, 8192, {false, true, false, true}));
  const double model = static_cast<double>(fleet.ModelBytes());
  const double sent_before = Metric(*fleet.trainer, "refit_data_bytes_sent_total");
  fleet.PublishAndCheck(1);
  std::this_thread::sleep_for(milliseconds(300));
  const double sent = Metric(*fleet.trainer, "refit_data_bytes_sent_total") - sent_before;
  INFO("trainer sent " << sent / model << " models");
  REQUIRE(sent <= 1.6 * model);  // half-row engines don't relay the rows they don't hold
  REQUIRE(fleet.RelaySent() > 0.5 * model);
}

TEST_CASE("a relay serving wrong bytes is caught: those chunks come from the trainer",
          "[integration][fanout]") {
  Fleet fleet(Loopback(3, 8192, {}, {}, {{"REFIT_FAULT_RELAY_FLIP=1000"}}));
  // engine-0 corrupts its own slot as it serves it (a node with bad memory would too), after it
  // verified its reads: its own copy is not checked, only that nobody else takes its bytes.
  fleet.PublishAndCheck(1, {0});
  double rejected = 0;
  for (size_t i = 1; i < fleet.engines.size(); ++i) {
    rejected += Metric(*fleet.engines[i].client, "refit_relay_chunks_rejected_total");
  }
  REQUIRE(rejected > 0);
  fleet.PublishAndCheck(2, {0});
}

TEST_CASE("a relay killed mid-transfer: the others take its stripes from the trainer",
          "[integration][fanout]") {
  Fleet fleet(Loopback(4, 32768));  // 256 MiB: long enough to kill a relay while it pulls
  fleet.PublishAndCheck(1);
  Fill(*fleet.source, 2 * 7919);
  REQUIRE(fleet.trainer->Publish("m", 2, {fleet.source_id}).ok());
  // Kill engine-0 once bytes of version 2 are moving on it.
  for (int i = 0; i < 2000; ++i) {
    auto s = fleet.engines[0].client->Status();
    REQUIRE(s.ok());
    bool moving = false;
    for (const auto& t : s->transfers())
      moving = moving || (t.version() == 2 && t.bytes_done() > 0);
    if (moving) break;
    std::this_thread::sleep_for(milliseconds(2));
  }
  fleet.engines[0].daemon->Stop(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  fleet.CheckEngines(2, {0});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  INFO("the others completed " << took << " s after the kill");
  REQUIRE(took < 20);
  fleet.PublishAndCheck(3, {0});
}

TEST_CASE("--relay=false: every byte comes from the trainer's node", "[integration][fanout]") {
  Fleet fleet(Loopback(2, 4096, {}, {{"--relay=false"}, {"--relay=false"}}));
  const double model = static_cast<double>(fleet.ModelBytes());
  fleet.PublishAndCheck(1);
  std::this_thread::sleep_for(milliseconds(300));
  REQUIRE(Metric(*fleet.trainer, "refit_data_bytes_sent_total") >= 1.9 * model);
  REQUIRE(fleet.RelaySent() == 0);
}

// The ranges a Relay stream announced (merged) until it said complete.
std::vector<std::pair<uint64_t, uint64_t>> Announced(v1::Peer::Stub* stub,
                                                     const v1::RelayRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Relay(&context, request);
  std::vector<std::pair<uint64_t, uint64_t>> told;
  v1::RelayProgress progress;
  bool complete = false;
  while (!complete && reader->Read(&progress)) {
    for (const auto& r : progress.landed()) told.emplace_back(r.offset(), r.offset() + r.length());
    complete = progress.complete();
  }
  context.TryCancel();
  (void)reader->Finish();
  REQUIRE(complete);
  return testing::Merged(std::move(told));
}

TEST_CASE("a Relay stream tells its reader only of the ranges it asked for",
          "[integration][fanout]") {
  Fleet fleet(Loopback(2, 1024));
  fleet.PublishAndCheck(1);
  auto status = fleet.engines[0].client->Status();
  REQUIRE(status.ok());
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel(At(status->listen_port()), grpc::InsecureChannelCredentials()));
  v1::RelayRequest request;
  request.set_model("m");
  request.set_version(1);
  request.set_node("reader");
  request.set_origin("trainer");
  request.set_buffer_id(fleet.source_id);
  const uint64_t bytes = fleet.ModelBytes();
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  // Asked for nothing (an older reader): told of the whole piece.
  REQUIRE(Announced(stub.get(), request) == Ranges{{0, bytes}});
  // Asked for two ranges, plus an empty one and one that wraps around: told of those two only.
  for (const auto& [offset, length] : std::vector<std::pair<uint64_t, uint64_t>>{
           {4096, 4096}, {1 << 20, 100}, {777, 0}, {~uint64_t{0} - 10, 100}}) {
    v1::ByteRange* range = request.add_wanted();
    range->set_offset(offset);
    range->set_length(length);
  }
  REQUIRE(Announced(stub.get(), request) == Ranges{{4096, 8192}, {1 << 20, (1 << 20) + 100}});
  fleet.PublishAndCheck(2);  // still serving
}

TEST_CASE("bad relay and replica requests get clear codes and change nothing",
          "[integration][fanout]") {
  Fleet fleet(Loopback(2, 1024));
  fleet.PublishAndCheck(1);
  auto status = fleet.engines[0].client->Status();
  REQUIRE(status.ok());
  auto channel = grpc::CreateChannel(At(status->listen_port()), grpc::InsecureChannelCredentials());
  auto stub = v1::Peer::NewStub(channel);
  {  // a version it never pulled
    grpc::ClientContext context;
    v1::RelayRequest request;
    request.set_model("m");
    request.set_version(99);
    request.set_node("stranger");
    request.set_origin("trainer");
    request.set_buffer_id("nope");
    auto reader = stub->Relay(&context, request);
    v1::RelayProgress progress;
    REQUIRE_FALSE(reader->Read(&progress));
    REQUIRE(reader->Finish().error_code() == grpc::StatusCode::NOT_FOUND);
  }
  for (const std::string& piece : {std::string("nope"), std::string()}) {
    // a version it holds, but a piece it does not (or from an origin it never pulled from)
    grpc::ClientContext context;
    v1::RelayRequest request;
    request.set_model("m");
    request.set_version(1);
    request.set_node("stranger");
    request.set_origin(piece.empty() ? "elsewhere" : "trainer");
    request.set_buffer_id(piece.empty() ? fleet.source_id : piece);
    auto reader = stub->Relay(&context, request);
    v1::RelayProgress progress;
    REQUIRE_FALSE(reader->Read(&progress));
    REQUIRE(reader->Finish().error_code() == grpc::StatusCode::NOT_FOUND);
  }
  auto trainer_status = fleet.trainer->Status();
  REQUIRE(trainer_status.ok());
  auto trainer_stub = v1::Peer::NewStub(
      grpc::CreateChannel(At(trainer_status->listen_port()), grpc::InsecureChannelCredentials()));
  {  // a replica claiming a version the trainer never published; a node not subscribed there
    grpc::ClientContext context;
    v1::ReplicaReport report;
    report.set_node("liar");
    report.set_relay(true);
    auto* m = report.add_models();
    m->set_model("m");
    m->set_latest_version(1000);
    v1::ReplicaReportResponse response;
    REQUIRE(trainer_stub->Report(&context, report, &response).error_code() ==
            grpc::StatusCode::FAILED_PRECONDITION);
  }
  {  // a report in this node's own name
    grpc::ClientContext context;
    v1::ReplicaReport report;
    report.set_node("trainer");
    v1::ReplicaReportResponse response;
    REQUIRE(trainer_stub->Report(&context, report, &response).error_code() ==
            grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto after = fleet.trainer->Status();
  REQUIRE(after.ok());
  REQUIRE(after->models(0).replicas_size() == 2);
  for (const auto& r : after->models(0).replicas()) REQUIRE(r.node() != "liar");
  fleet.PublishAndCheck(2);
}

}  // namespace refit
