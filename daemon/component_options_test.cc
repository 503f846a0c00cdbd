// component_options: refitd's defaults live in DaemonOptions alone (daemon/config's table prints
// them) and reach each part through the mapping Daemon::Start uses; the parts' own option
// structs hold no competing default.

#include "daemon/component_options.h"

#include <string>

#include "absl/strings/numbers.h"
#include "catch2/catch.hpp"
#include "daemon/config/option_table.h"
#include "daemon/pull/puller.h"

namespace refit {
namespace {

// The default the option table documents for config key `key` (docs/api.md, --help).
std::string Table(const std::string& key) {
  const config::OptionSpec* spec = config::FindByKey(key);
  REQUIRE(spec != nullptr);
  return config::DefaultText(*spec);
}

double TableNumber(const std::string& key) {
  double value = 0;
  REQUIRE(absl::SimpleAtod(Table(key), &value));
  return value;
}

bool TableBool(const std::string& key) {
  const std::string text = Table(key);
  REQUIRE((text == "true" || text == "false"));
  return text == "true";
}

TEST_CASE("the option table's defaults reach every part", "[options]") {
  DaemonOptions daemon;  // every default, as the table prints them
  daemon.node = "a";     // main.cc: the host name

  auto store = StoreOptionsFrom(daemon);
  REQUIRE(store.ok());
  CHECK(store->retain == TableNumber("retain"));
  CHECK(store->node == "a");
  CHECK(store->max_slot_bytes == TableNumber("max_slot_memory"));
  CHECK(store->max_gpu_slot_bytes == TableNumber("max_gpu_slot_memory"));
  CHECK(Table("slot_memory") == "`host`");
  CHECK(store->slot_memory == MemoryKind::kHost);
  CHECK(store->slot_device == TableNumber("slot_device"));
  CHECK(Table("delta_base") == "`held`");
  CHECK(store->delta_base == DeltaBase::kHeld);
  CHECK(store->delta_base_models.empty());
  CHECK(store->journal_dir.empty());  // no --state-dir (main.cc: $STATE_DIRECTORY)
  CHECK(CheckStoreOptions(*store).ok());

  const dataplane::DataPlaneOptions data_plane = DataPlaneOptionsFrom(daemon);
  CHECK(data_plane.chunk_bytes == TableNumber("chunk_bytes"));
  CHECK(data_plane.inflight == TableNumber("inflight"));
  CHECK(data_plane.relay_chunk_bytes == TableNumber("relay_chunk_bytes"));

  const peer::DeltaSourceOptions deltas = DeltaSourceOptionsFrom(daemon);
  CHECK(deltas.threshold == TableNumber("delta_threshold"));
  CHECK(deltas.chain == TableNumber("delta_chain"));

  const bucket::ExporterOptions exporter = ExporterOptionsFrom(daemon);
  CHECK(exporter.full_every == TableNumber("bucket_full_every"));
  CHECK(exporter.retain == TableNumber("retain"));

  const peer::PeerServiceOptions service = PeerServiceOptionsFrom(daemon, /*tls=*/false);
  CHECK(service.relay == TableBool("relay"));
  CHECK(service.max_relay_readers == TableNumber("max_peer_connections"));
  CHECK_FALSE(service.tls);
  CHECK(PeerServiceOptionsFrom(daemon, /*tls=*/true).tls);

  const peer::PeerManagerOptions peers = PeerManagerOptionsFrom(daemon);
  CHECK(peers.node == "a");
  CHECK(peers.delta_threshold == TableNumber("delta_threshold"));
  CHECK(peers.relay == TableBool("relay"));
  CHECK(peers.max_peer_connections == TableNumber("max_peer_connections"));
  CHECK(Table("site") == "none");
  CHECK(peers.site.empty());

  // ... and on, through PeerManager, to the puller, the relay channels and the reporter.
  const pull::PullerOptions puller = peer::PullerOptionsFor(peers);
  CHECK(puller.delta_threshold == TableNumber("delta_threshold"));
  CHECK(puller.relay == TableBool("relay"));
  const peer::RelayChannelsOptions channels = peer::RelayChannelsOptionsFor(peers);
  CHECK(channels.relay == TableBool("relay"));
  CHECK(channels.max_channels == TableNumber("max_peer_connections"));
  CHECK(peer::ReplicaReporterOptionsFor(peers).relay == TableBool("relay"));
}

// A mapping that forgot a field would leave the part's neutral value; where a default is the
// neutral value too (0: no limit, "": no site, device 0), only other values tell.
TEST_CASE("options other than the defaults reach every part", "[options]") {
  DaemonOptions daemon;
  daemon.node = "b";
  daemon.retain = 5;
  daemon.max_slot_memory = uint64_t{1} << 30;
  daemon.max_gpu_slot_memory = uint64_t{3} << 30;
  daemon.slot_device = 3;  // kept for --slot-memory=cuda; host slots here
  daemon.delta_base = "destination,critic=held";
  daemon.state_dir = "/var/lib/refit";
  daemon.chunk_bytes = uint64_t{1} << 20;
  daemon.inflight = 7;
  daemon.relay_chunk_bytes = uint64_t{128} << 10;
  daemon.delta_threshold = 0.25;
  daemon.delta_chain = 9;
  daemon.bucket_full_every = 3;
  daemon.relay = false;
  daemon.max_peer_connections = 5;
  daemon.site = "rack-2";

  auto store = StoreOptionsFrom(daemon);
  REQUIRE(store.ok());
  CHECK(store->retain == 5);
  CHECK(store->node == "b");
  CHECK(store->max_slot_bytes == uint64_t{1} << 30);
  CHECK(store->max_gpu_slot_bytes == uint64_t{3} << 30);
  CHECK(store->slot_memory == MemoryKind::kHost);
  CHECK(store->slot_device == 3);
  CHECK(store->delta_base == DeltaBase::kDestination);
  REQUIRE(store->delta_base_models.count("critic") == 1);
  CHECK(store->delta_base_models.at("critic") == DeltaBase::kHeld);
  CHECK(store->journal_dir == "/var/lib/refit");

  const dataplane::DataPlaneOptions data_plane = DataPlaneOptionsFrom(daemon);
  CHECK(data_plane.chunk_bytes == uint64_t{1} << 20);
  CHECK(data_plane.inflight == 7);
  CHECK(data_plane.relay_chunk_bytes == uint64_t{128} << 10);

  const peer::DeltaSourceOptions deltas = DeltaSourceOptionsFrom(daemon);
  CHECK(deltas.threshold == 0.25);
  CHECK(deltas.chain == 9);

  const bucket::ExporterOptions exporter = ExporterOptionsFrom(daemon);
  CHECK(exporter.full_every == 3);
  CHECK(exporter.retain == 5);

  const peer::PeerServiceOptions service = PeerServiceOptionsFrom(daemon, /*tls=*/true);
  CHECK_FALSE(service.relay);
  CHECK(service.max_relay_readers == 5);

  const peer::PeerManagerOptions peers = PeerManagerOptionsFrom(daemon);
  CHECK(peers.node == "b");
  CHECK(peers.delta_threshold == 0.25);
  CHECK_FALSE(peers.relay);
  CHECK(peers.max_peer_connections == 5);
  CHECK(peers.site == "rack-2");
  const pull::PullerOptions puller = peer::PullerOptionsFor(peers);
  CHECK(puller.delta_threshold == 0.25);
  CHECK_FALSE(puller.relay);
  CHECK(puller.site == "rack-2");
  CHECK(peer::RelayChannelsOptionsFor(peers).max_channels == 5);
  CHECK(peer::ReplicaReporterOptionsFor(peers).site == "rack-2");

  daemon.delta_base = "sometimes";
  CHECK(StoreOptionsFrom(daemon).status().code() == absl::StatusCode::kInvalidArgument);
  daemon.delta_base = "held";
  daemon.slot_memory = "disk";
  CHECK(StoreOptionsFrom(daemon).status().code() == absl::StatusCode::kInvalidArgument);
}

// The parts' structs, left unset, hold neutral values (off, 0, or one their part refuses): no
// second default that could drift from the table's.
TEST_CASE("the parts' option structs carry no default of a refitd option", "[options]") {
  const StoreOptions store;
  CHECK(store.retain == 0);
  CHECK(store.node.empty());
  const absl::Status unset = CheckStoreOptions(store);
  CHECK(unset.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(unset.message()).find("--retain") != std::string::npos);
  StoreOptions named = store;
  named.retain = 2;
  CHECK(std::string(CheckStoreOptions(named).message()).find("--node") != std::string::npos);

  const dataplane::DataPlaneOptions data_plane;
  CHECK(data_plane.chunk_bytes == 0);
  CHECK(data_plane.inflight == 0);
  CHECK(data_plane.relay_chunk_bytes == 0);
  const peer::DeltaSourceOptions deltas;
  CHECK(deltas.threshold == 0);
  CHECK(deltas.chain == 0);
  const bucket::ExporterOptions exporter;
  CHECK(exporter.full_every == 0);
  CHECK(exporter.retain == 0);
  const peer::PeerServiceOptions service;
  CHECK_FALSE(service.relay);
  CHECK(service.max_relay_readers == 0);
  const peer::PeerManagerOptions peers;
  CHECK(peers.delta_threshold == 0);
  CHECK_FALSE(peers.relay);
  CHECK(peers.max_peer_connections == 0);
  const pull::PullerOptions puller;
  CHECK(puller.delta_threshold == 0);
  CHECK_FALSE(puller.relay);
  const peer::RelayChannelsOptions channels;
  CHECK_FALSE(channels.relay);
  CHECK(channels.max_channels == 0);
  CHECK_FALSE(peer::ReplicaReporterOptions{}.relay);
}

}  // namespace
}  // namespace refit
