// Delta sync through two real daemons, on the real successive bf16 versions of a trained model
// (../shared/data/deltas/tiny-llama-lr1e-6, v000..v003). The trainer node holds the model as
// one SOURCE buffer; the engine node holds tensor-parallel rank 0 of 2 (q/k/v/gate/up/embed
// split on rows, o/down on columns, norms whole), so each delta is applied to only part of the
// source buffer. Every version must arrive bit-exact, the first in full and the later ones as
// deltas whose wire bytes are exactly the delta bytes covering what rank 0 needs; and the
// fall-backs (threshold, restart, missed versions) stay exact.

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "daemon/delta/delta.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/real_model.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

constexpr int kVersions = 4;
constexpr uint64_t kChunkElements = uint64_t{1} << 18;  // DeltaSourceOptions' default

using testing::Data;
using testing::Engine;
using testing::Load;
using testing::MakeEngine;
using testing::Merged;
using testing::Ranges;
using testing::Tensor;

// The delta bytes a receiver needing `needed` reads: header + the chunks covering it.
uint64_t DeltaWireBytes(const std::vector<uint8_t>& base, const std::vector<uint8_t>& target,
                        const Ranges& needed) {
  delta::EncodeOptions options;
  options.chunk_elements = kChunkElements;
  auto encoded = delta::Encode(base.data(), target.data(), base.size(), DType::kBF16, options);
  REQUIRE(encoded.ok());
  auto index = delta::ParseIndex(encoded->data(), encoded->size());
  REQUIRE(index.ok());
  std::vector<bool> used(index->chunks.size(), false);
  for (const auto& [b, e] : needed) {
    for (size_t c : delta::ChunksOverlapping(*index, b / 2, (e - b) / 2)) used[c] = true;
  }
  uint64_t wire = index->header_size;
  for (size_t c = 0; c < used.size(); ++c) {
    if (used[c]) wire += index->chunks[c].encoded_size;
  }
  return wire;
}

using testing::Metric;

struct Cluster {
  Data data;
  Engine engine;
  std::unique_ptr<testing::DaemonProcess> trainer_node, engine_node;
  std::unique_ptr<client::Client> trainer, client;
  std::unique_ptr<SharedMemory> source, dest;
  std::string source_id, dest_id;
  int port = 0;
  // The engine holds the whole source buffer in the source's layout (whole delta chunks),
  // instead of tensor-parallel rank 0.
  bool whole = false;

  void StartEngine(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--node=engine", "--peers=127.0.0.1:" + std::to_string(port)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto started = testing::DaemonProcess::Start(args);
    REQUIRE(started.ok());
    engine_node = std::move(started).value();
    auto c = engine_node->Connect();
    REQUIRE(c.ok());
    client = std::move(c).value();
    for (int i = 0; i < 200; ++i) {
      auto s = client->Status();
      if (s.ok() && s->peers_size() == 1 && s->peers(0).connected()) break;
      std::this_thread::sleep_for(milliseconds(50));
    }
    const uint64_t bytes = whole ? data.versions[0].size() : engine.bytes;
    dest = std::make_unique<SharedMemory>(
        SharedMemory::Create(testing::UniqueShmName("tp2"), bytes).value());
    auto id = client->RegisterBuffer("tiny-llama", v1::DESTINATION, dest->name(),
                                     whole ? testing::SourceSlices(data) : engine.slices);
    REQUIRE(id.ok());
    dest_id = *id;
  }

  void Start(const std::vector<std::string>& engine_args) {
    data = Load();
    engine = MakeEngine(data);
    auto t = testing::DaemonProcess::Start({"--node=trainer"});
    REQUIRE(t.ok());
    trainer_node = std::move(t).value();
    auto tc = trainer_node->Connect();
    REQUIRE(tc.ok());
    trainer = std::move(tc).value();
    port = trainer->Status()->listen_port();
    source = std::make_unique<SharedMemory>(
        SharedMemory::Create(testing::UniqueShmName("src"), data.versions[0].size()).value());
    auto id = trainer->RegisterBuffer("tiny-llama", v1::SOURCE, source->name(),
                                      testing::SourceSlices(data));
    REQUIRE(id.ok());
    source_id = *id;
    StartEngine(engine_args);
  }

  // Publishes shared version `v` (0-based) as refit version v + 1.
  void Publish(int v) {
    std::memcpy(source->data(), data.versions[v].data(), data.versions[v].size());
    REQUIRE(trainer->Publish("tiny-llama", v + 1, {source_id}).ok());
  }

  // Waits for refit version v + 1 on the engine, applies it and compares bit for bit.
  void ReceiveAndCheck(int v) {
    auto got = client->WaitForVersion("tiny-llama", v + 1, milliseconds(60000));
    REQUIRE(got.ok());
    REQUIRE(*got == static_cast<uint64_t>(v + 1));
    std::memset(dest->data(), 0xAB, dest->size());
    auto applied = client->Apply("tiny-llama", v + 1, {dest_id});
    REQUIRE(applied.ok());
    if (whole) {
      CHECK(std::memcmp(dest->data(), data.versions[v].data(), data.versions[v].size()) == 0);
    } else {
      CHECK(testing::CountWrongRuns(engine, dest->data(), data.versions[v]) == 0);
    }
  }

  // As ReceiveAndCheck, but into the destination as the last Apply left it (holding v), so
  // that a sparse Apply may write only what changed.
  void ReceiveInPlaceAndCheck(int v) {
    auto got = client->WaitForVersion("tiny-llama", v + 1, milliseconds(60000));
    REQUIRE(got.ok());
    REQUIRE(*got == static_cast<uint64_t>(v + 1));
    auto applied = client->Apply("tiny-llama", v + 1, {dest_id});
    REQUIRE(applied.ok());
    CHECK(std::memcmp(dest->data(), data.versions[v].data(), data.versions[v].size()) == 0);
  }

  double Received() { return Metric(*client, "refit_data_bytes_received_total"); }
};

TEST_CASE("real bf16 versions sync as deltas, resharded, bit-exact", "[integration][delta]") {
  Cluster c;
  if (Load().versions.empty()) {
    FAIL("the shared data is missing: set REFIT_SHARED_DIR (scripts/test.sh does)");
  }
  c.Start({});
  const Ranges needed = Merged(c.engine.source_runs);
  uint64_t needed_bytes = 0;
  for (const auto& [b, e] : needed) needed_bytes += e - b;
  REQUIRE(needed_bytes == c.engine.bytes);

  c.Publish(0);
  c.ReceiveAndCheck(0);
  CHECK(c.Received() == static_cast<double>(needed_bytes));  // no base yet: in full
  double total = c.Received();
  for (int v = 1; v < kVersions; ++v) {
    c.Publish(v);
    c.ReceiveAndCheck(v);
    const uint64_t expected = DeltaWireBytes(c.data.versions[v - 1], c.data.versions[v], needed);
    const double wire = c.Received() - total;
    total = c.Received();
    CHECK(wire == static_cast<double>(expected));
    WARN("version " << v << ": " << wire << " wire bytes for " << needed_bytes << " needed bytes: "
                    << static_cast<double>(needed_bytes) / wire << "x smaller");
    CHECK(wire * 100 < static_cast<double>(needed_bytes));
  }
  CHECK(Metric(*c.client, "refit_delta_versions_total") == kVersions - 1);
  CHECK(Metric(*c.client, "refit_full_versions_total") == 1);
  // The source counts what receivers read from it.
  CHECK(Metric(*c.trainer, "refit_data_bytes_sent_total") == total);
}

TEST_CASE("deltas above --delta-threshold are not used", "[integration][delta]") {
  Cluster c;
  REQUIRE_FALSE(Load().versions.empty());
  c.Start({"--delta-threshold=0.001"});  // the real deltas are ~0.3 % of the bytes
  for (int v = 0; v < kVersions; ++v) {
    c.Publish(v);
    c.ReceiveAndCheck(v);
  }
  CHECK(c.Received() == static_cast<double>(kVersions * c.engine.bytes));
  CHECK(Metric(*c.client, "refit_delta_versions_total") == 0);
  CHECK(Metric(*c.client, "refit_full_versions_total") == kVersions);
}

TEST_CASE("a restarted receiver pulls in full, then deltas again", "[integration][delta]") {
  Cluster c;
  REQUIRE_FALSE(Load().versions.empty());
  c.Start({});
  c.Publish(0);
  c.ReceiveAndCheck(0);
  c.Publish(1);
  c.ReceiveAndCheck(1);
  CHECK(Metric(*c.client, "refit_delta_versions_total") == 1);
  c.client.reset();
  c.dest.reset();
  REQUIRE(c.engine_node->Stop(SIGTERM) == 0);
  c.StartEngine({});
  c.ReceiveAndCheck(1);  // the newest version again, with no base: in full
  CHECK(c.Received() == static_cast<double>(c.engine.bytes));
  c.Publish(2);
  c.ReceiveAndCheck(2);
  CHECK(Metric(*c.client, "refit_full_versions_total") == 1);
  CHECK(Metric(*c.client, "refit_delta_versions_total") == 1);
  CHECK(c.Received() < 1.1 * static_cast<double>(c.engine.bytes));
}

TEST_CASE("a receiver that missed versions catches up through the deltas", "[integration][delta]") {
  Cluster c;
  REQUIRE_FALSE(Load().versions.empty());
  c.Start({});
  c.Publish(0);
  c.ReceiveAndCheck(0);
  // The engine's daemon sleeps through versions 2 and 3 (base 1 -> 2 -> 3 chain, or 2 then 3).
  REQUIRE(kill(c.engine_node->pid(), SIGSTOP) == 0);
  c.Publish(1);
  c.Publish(2);
  std::this_thread::sleep_for(milliseconds(500));  // both announced while it sleeps
  REQUIRE(kill(c.engine_node->pid(), SIGCONT) == 0);
  c.ReceiveAndCheck(2);
  c.Publish(3);
  c.ReceiveAndCheck(3);
  CHECK(Metric(*c.client, "refit_full_versions_total") == 1);
  CHECK(Metric(*c.client, "refit_delta_versions_total") >= 2);
  CHECK(c.Received() < 1.1 * static_cast<double>(c.engine.bytes));
}

TEST_CASE("an engine holding whole chunks builds each delta version in cache, bit-exact",
          "[integration][delta]") {
  // Whole delta chunks take the other build path: each changed chunk is copied from the base
  // into a buffer, patched and checked there, and streamed into the staging slot.
  Cluster c;
  REQUIRE_FALSE(Load().versions.empty());
  c.whole = true;
  c.Start({});
  c.Publish(0);
  c.ReceiveAndCheck(0);
  c.Publish(1);
  c.ReceiveAndCheck(1);  // one step
  // Two versions while the engine's daemon sleeps: a chain of two steps on one chunk buffer.
  REQUIRE(kill(c.engine_node->pid(), SIGSTOP) == 0);
  c.Publish(2);
  c.Publish(3);
  std::this_thread::sleep_for(milliseconds(500));
  REQUIRE(kill(c.engine_node->pid(), SIGCONT) == 0);
  c.ReceiveAndCheck(3);
  CHECK(Metric(*c.client, "refit_full_versions_total") == 1);
  CHECK(Metric(*c.client, "refit_delta_versions_total") >= 2);
  CHECK(Metric(*c.client, "refit_delta_fallbacks_total") == 0);
  // Full bytes once, then only deltas.
  CHECK(c.Received() < 1.1 * static_cast<double>(c.data.versions[0].size()));
}

TEST_CASE("a delta version's sparse Apply takes the changes its deltas gathered, no diff",
          "[integration][delta][sparse]") {
  // Whole delta chunks: building each version from its delta also gathers what changed (runs
  // and new words) while each chunk is in cache. The engine's node then has no diff to make
  // for its sparse Apply (refit_diff_bytes_total stays 0 after the full first version, whose
  // destination held nothing yet), and every Apply is bit-exact, a chain of two steps included.
  Cluster c;
  REQUIRE_FALSE(Load().versions.empty());
  c.whole = true;
  c.Start({});
  c.Publish(0);
  c.ReceiveInPlaceAndCheck(0);
  const double diffed = Metric(*c.client, "refit_diff_bytes_total");
  c.Publish(1);
  c.ReceiveInPlaceAndCheck(1);
  REQUIRE(kill(c.engine_node->pid(), SIGSTOP) == 0);
  c.Publish(2);
  c.Publish(3);
  std::this_thread::sleep_for(milliseconds(500));
  REQUIRE(kill(c.engine_node->pid(), SIGCONT) == 0);
  c.ReceiveInPlaceAndCheck(3);
  CHECK(Metric(*c.client, "refit_delta_versions_total") >= 2);
  CHECK(Metric(*c.client, "refit_delta_fallbacks_total") == 0);
  CHECK(Metric(*c.client, "refit_apply_sparse_total") >= 1);  // version 2 (4: the cost model)
  CHECK(Metric(*c.client, "refit_diff_bytes_total") == diffed);
}

}  // namespace
}  // namespace refit
