// Bounded peer connections (issue 16, part 6): engine nodes whose --peers name only the
// trainer's node learn who else pulls from the trainer's answers to their replica reports, and
// open control channels on demand to the relays the stripe plan gives them, never more than
// --max-peer-connections; idle relay channels close. Every version still arrives bit-exact on
// every engine, through relays, with the trainer's node sending it about once.

#include <cstdio>
#include <thread>

#include "catch2/catch.hpp"
#include "tests/testing/fleet.h"

namespace refit {
namespace {

using std::chrono::milliseconds;
using testing::Fleet;
using testing::Metric;

constexpr char kChannelsOpen[] = "refit_peer_channels_open";

testing::FleetOptions TrainerOnly(int engines, int64_t rows,
                                  std::vector<std::string> engine_args = {},
                                  std::vector<std::string> engine_env = {}) {
  testing::FleetOptions options;
  options.engines = engines;
  options.rows = rows;
  options.peers_trainer_only = true;
  options.engine_args.assign(engines, engine_args);
  options.engine_env.assign(engines, engine_env);
  return options;
}

// Every engine's open control channels, each checked against `cap`; their sum.
double ChannelsOpen(Fleet& fleet, double cap) {
  double total = 0;
  for (size_t i = 0; i < fleet.engines.size(); ++i) {
    const double open = Metric(*fleet.engines[i].client, kChannelsOpen);
    INFO("engine-" << i << " has " << open << " peer channels open (cap " << cap << ")");
    REQUIRE(open >= 1);  // the trainer's node
    REQUIRE(open <= cap);
    total += open;
  }
  return total;
}

// Each engine's --peers is the trainer's node only.
void RequireOnePeer(Fleet& fleet) {
  for (auto& e : fleet.engines) {
    auto status = e.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->peers_size() == 1);
    REQUIRE(status->peers(0).node() == "trainer");
    REQUIRE(status->peers(0).connected());
  }
}

}  // namespace

TEST_CASE("engines that know only the trainer relay to each other, within the channel cap",
          "[integration][fanout]") {
  // 8 engines, 64 MiB (16 checksum chunks of 4 MiB: each of the 8 stripes holds two, so every
  // engine relays one); relay channels close after 2 s unused.
  Fleet fleet(
      TrainerOnly(8, 8192, {"--max-peer-connections=9"}, {"REFIT_TEST_RELAY_IDLE_MS=2000"}));
  RequireOnePeer(fleet);
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 3; ++v) {
    const double sent_before = Metric(*fleet.trainer, "refit_data_bytes_sent_total");
    const double relayed_before = fleet.RelaySent();
    fleet.PublishAndCheck(v);
    std::this_thread::sleep_for(milliseconds(300));  // the pins' releases count the bytes
    ChannelsOpen(fleet, 9);
    const double sent = Metric(*fleet.trainer, "refit_data_bytes_sent_total") - sent_before;
    const double relayed = fleet.RelaySent() - relayed_before;
    INFO("version " << v << ": trainer sent " << sent / model << " models, relays "
                    << relayed / model);
    std::printf("version %llu: the trainer's node sent %.3f models, the relays %.3f\n",
                static_cast<unsigned long long>(v), sent / model, relayed / model);
    REQUIRE(sent >= 0.9 * model);
    REQUIRE(sent <= 1.25 * model);
    REQUIRE(relayed >= 5.5 * model);  // 7/8 of the model to each of 8 nodes
  }
  for (size_t i = 0; i < fleet.engines.size(); ++i) {
    INFO("engine-" << i);
    REQUIRE(Metric(*fleet.engines[i].client, "refit_relay_bytes_sent_total") > 0);
    REQUIRE(Metric(*fleet.engines[i].client, "refit_relay_bytes_received_total") > 0);
  }
  // The trainer's node knows all eight; so does every engine, through the trainer.
  for (auto& e : fleet.engines) {
    auto status = e.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models_size() == 1);
    REQUIRE(status->models(0).replicas_size() == 8);
  }
  // Unused, the relay channels close; the next version opens them again.
  for (int round = 0; round < 100 && ChannelsOpen(fleet, 9) > 8; ++round) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  REQUIRE(ChannelsOpen(fleet, 9) == 8);  // each engine: the trainer's node only
  const double relayed_before = fleet.RelaySent();
  fleet.PublishAndCheck(4);
  REQUIRE(fleet.RelaySent() - relayed_before >= 5.5 * model);
  ChannelsOpen(fleet, 9);
}

TEST_CASE("a small --max-peer-connections bounds the channels; the rest comes from the trainer",
          "[integration][fanout]") {
  Fleet fleet(TrainerOnly(6, 2048, {"--max-peer-connections=3"}));
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 2; ++v) {
    fleet.PublishAndCheck(v);
    ChannelsOpen(fleet, 3);
  }
  std::this_thread::sleep_for(milliseconds(300));
  INFO("trainer sent " << Metric(*fleet.trainer, "refit_data_bytes_sent_total") / model
                       << " models, relays " << fleet.RelaySent() / model);
  REQUIRE(fleet.RelaySent() > 0);  // two relay channels each
}

TEST_CASE("--relay=false with only the trainer in --peers: nobody else is contacted",
          "[integration][fanout]") {
  Fleet fleet(TrainerOnly(4, 2048, {"--relay=false"}));
  const double model = static_cast<double>(fleet.ModelBytes());
  fleet.PublishAndCheck(1);
  fleet.PublishAndCheck(2);
  std::this_thread::sleep_for(milliseconds(300));
  REQUIRE(ChannelsOpen(fleet, 1) == 4);
  REQUIRE(fleet.RelaySent() == 0);
  REQUIRE(fleet.Sum("refit_relay_bytes_received_total") == 0);
  REQUIRE(Metric(*fleet.trainer, "refit_data_bytes_sent_total") >= 2 * 4 * 0.99 * model);
  // Each engine still knows the others as replicas (from the trainer), without a channel.
  for (auto& e : fleet.engines) {
    auto status = e.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models(0).replicas_size() == 4);
  }
}

}  // namespace refit

namespace refit {

TEST_CASE("incoming relay readers are capped by --max-peer-connections too",
          "[integration][fanout]") {
  // A full mesh (--peers names everyone: those channels are always open), so only the incoming
  // side bounds who reads from whom: each stripe's relay has five readers and serves three;
  // the other two read that stripe from the trainer's node.
  testing::FleetOptions options;
  options.engines = 6;
  options.rows = 4096;  // 32 MiB: 8 chunks, each engine a stripe's relay
  options.engine_args.assign(6, {"--max-peer-connections=3"});
  Fleet fleet(std::move(options));
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 3; ++v) {
    const double sent_before = Metric(*fleet.trainer, "refit_data_bytes_sent_total");
    fleet.PublishAndCheck(v);
    std::this_thread::sleep_for(milliseconds(300));
    for (size_t i = 0; i < fleet.engines.size(); ++i) {
      INFO("engine-" << i);
      REQUIRE(Metric(*fleet.engines[i].client, "refit_relay_readers") <= 3);
    }
    const double sent = Metric(*fleet.trainer, "refit_data_bytes_sent_total") - sent_before;
    std::printf("capped readers, version %llu: the trainer's node sent %.3f models\n",
                static_cast<unsigned long long>(v), sent / model);
  }
  const double refused = fleet.Sum("refit_relay_readers_refused_total");
  INFO("relay streams refused: " << refused);
  REQUIRE(refused > 0);
  REQUIRE(fleet.RelaySent() > 0);
  // Refused readers are not relay failures.
  REQUIRE(fleet.Sum("refit_relay_failovers_total") == 0);
}

}  // namespace refit

namespace refit {

TEST_CASE("two trainer nodes, each publishing half the model: engines that know only them relay",
          "[integration][fanout]") {
  // Each engine's --peers names both trainer nodes only; each trainer's node answers its reports
  // with the engines subscribed to it, and the engine merges both answers.
  testing::FleetOptions options = TrainerOnly(4, 4096);  // 32 MiB, 16 MiB per trainer node
  options.trainers = 2;
  Fleet fleet(std::move(options));
  for (uint64_t v = 1; v <= 3; ++v) {
    const Fleet::HalvesSent sent = fleet.PublishAndCheckHalves(v);
    INFO("version " << v << ": trainer nodes sent " << sent.first << " and " << sent.second
                    << " of their halves, relays " << sent.relayed);
    REQUIRE(sent.first >= 0.9);
    REQUIRE(sent.first <= 1.25);
    REQUIRE(sent.second >= 0.9);
    REQUIRE(sent.second <= 1.25);
    REQUIRE(sent.relayed >= 2 * 2.5);  // 3/4 of each half to each of 4 nodes
    ChannelsOpen(fleet, 16);
  }
  // Every engine knows the other three (from both trainers' answers, merged) and both trainers
  // know all four.
  for (auto& e : fleet.engines) {
    auto status = e.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->peers_size() == 2);
    REQUIRE(status->models(0).replicas_size() == 4);
  }
  for (client::Client* t : {fleet.trainer.get(), fleet.second_trainer.get()}) {
    auto status = t->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models(0).replicas_size() == 4);
  }
}

}  // namespace refit
