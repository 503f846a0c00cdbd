// Sites (--site) across network namespaces: the trainer's node and two engine nodes in site "a",
// three engine nodes in site "b", each site's nodes on a bridge of their own with fast links
// (1 Gbit/s), the two bridges joined by one slow link (100 Mbit/s each way, tc tbf). Each
// version (full bytes or a delta) must cross the slow link once: counted on the link itself
// (its veth ends' transmit counters, everything included: at most 1.05 models) and by refit
// (refit_site_bytes_received_total on site b's nodes: at most 1.05 models). Bad input: a node whose
// site no one else has, and a site whose every engine node dies mid-version: every live node still
// completes every version bit-exact, and the lone node's warning names it; two nodes of one site
// each reading the same stripes across (two entries): the relays they read from warn naming
// them, and every version completes. Needs root and iproute2:
// where namespaces can't be made, every case FAILS (it is never silently green).

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "catch2/catch.hpp"
#include "tests/testing/fleet.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::Fill;
using testing::Fleet;
using testing::FleetOptions;
using testing::Metric;
using testing::Network;
using testing::NetworkSites;

constexpr int kEngines = 5;  // engine-0, engine-1 in "a"; engine-2, -3, -4 in "b"
constexpr char kSiteBytes[] = "refit_site_bytes_received_total";

std::unique_ptr<Network> MakeNetwork() {
  NetworkSites sites;
  sites.site = {0, 0, 0, 1, 1, 1};  // by node: the trainer, then the engines
  sites.wan_rate = "100mbit";
  return testing::RequireNetwork("fleets", kEngines + 1, "1gbit", &sites);
}

// A fresh directory for the daemons' logs.
std::string LogDir() {
  char dir[] = "/tmp/refit-fleet-sites-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  return dir;
}

FleetOptions TwoSites(Network* network, int64_t rows, std::vector<std::string> engine_sites) {
  FleetOptions options;
  options.engines = kEngines;
  options.rows = rows;
  options.network = network;
  options.trainer_args = {"--site=a"};
  for (const std::string& site : engine_sites) options.engine_args.push_back({"--site=" + site});
  options.log_dir = LogDir();
  return options;
}

double SumOf(Fleet& fleet, const std::string& metric, const std::vector<size_t>& nodes) {
  double total = 0;
  for (size_t i : nodes) total += Metric(*fleet.engines[i].client, metric);
  return total;
}

// Publish `version` (what the source holds) and wait for it on `nodes`: seconds from Publish
// returning to the last of them complete.
double PublishAndTime(Fleet& fleet, uint64_t version, const std::vector<size_t>& nodes) {
  fleet.Publish(version);
  const auto start = Clock::now();
  for (size_t i : nodes) {
    auto got = fleet.engines[i].client->WaitForVersion("m", version, milliseconds(120000));
    REQUIRE(got.ok());
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Bytes the TCP sockets of nodes `from` to nodes `to` retransmitted so far (ss -ti:
// bytes_retrans, summed over the connections open now).
double RetransmittedInto(Network& network, const std::vector<int>& from,
                         const std::vector<int>& to) {
  std::string filter;
  for (int n : to) filter += (filter.empty() ? "dst " : " or dst ") + network.Ip(n);
  double total = 0;
  for (int n : from) {
    std::string command;
    for (const std::string& part : network.In(n)) command += part + " ";
    command += "ss -tin '( " + filter + " )' | grep -o 'bytes_retrans:[0-9]*' | cut -d: -f2";
    FILE* f = popen(command.c_str(), "r");
    REQUIRE(f != nullptr);
    unsigned long long bytes = 0;
    while (fscanf(f, "%llu", &bytes) == 1) total += static_cast<double>(bytes);
    pclose(f);
  }
  return total;
}

}  // namespace

TEST_CASE("netns sites: each version crosses the slow link once, full bytes and deltas",
          "[integration][netns][fanout][sites]") {
  auto network = MakeNetwork();
  Fleet fleet(TwoSites(network.get(), 4096, {"a", "a", "b", "b", "b"}));  // 32 MiB
  const double model = static_cast<double>(fleet.ModelBytes());
  const std::vector<size_t> site_b = {2, 3, 4};
  for (uint64_t v = 1; v <= 3; ++v) {
    const double wan_before = static_cast<double>(network->WanBytes());
    const double retrans_before = RetransmittedInto(*network, {0, 1, 2}, {3, 4, 5});
    const double site_before = SumOf(fleet, kSiteBytes, site_b);
    const double sent_before = Metric(*fleet.trainer, "refit_data_bytes_sent_total");
    Fill(*fleet.source, v * 7919);
    const double t = PublishAndTime(fleet, v, site_b);
    fleet.CheckEngines(v);
    std::this_thread::sleep_for(milliseconds(500));  // the pins' releases carry the counts
    const double wan = static_cast<double>(network->WanBytes()) - wan_before;
    const double crossed = SumOf(fleet, kSiteBytes, site_b) - site_before;
    const double sent = Metric(*fleet.trainer, "refit_data_bytes_sent_total") - sent_before;
    std::printf(
        "sites, version %llu: site b complete %.3f s after Publish; the slow link carried %.3f "
        "models (refit counted %.3f crossing into b); the trainer's node sent %.3f models\n",
        static_cast<unsigned long long>(v), t, wan / model, crossed / model, sent / model);
    INFO("version " << v << ": link " << wan / model << " models, refit " << crossed / model
                    << ", trainer " << sent / model);
    // The link's own counters, everything included (control traffic, TCP retransmissions,
    // printed): 1.13-2.26 models per version until a relay stream that had said `complete`
    // stopped sending an empty message per turn while its reader still read (a flood of
    // gRPC frames on the slow link, docs/benchmarks.md, sites); 1.006-1.007 since.
    const double retransmitted = RetransmittedInto(*network, {0, 1, 2}, {3, 4, 5}) - retrans_before;
    std::printf("  of which TCP retransmissions from site a to site b: %.3f models\n",
                retransmitted / model);
    REQUIRE(wan <= 1.05 * model);
    REQUIRE(crossed >= 0.95 * model);
    REQUIRE(crossed <= 1.05 * model);
    REQUIRE(sent <= 1.10 * model);  // site b reads from site a's nodes, not the trainer's
  }
  // Deltas cross once too: site b's nodes together read about one node's delta across.
  for (uint64_t v = 4; v <= 5; ++v) {
    const double wan_before = static_cast<double>(network->WanBytes());
    const double site_before = SumOf(fleet, kSiteBytes, site_b);
    std::vector<double> delta_before;
    for (size_t i : site_b) {
      delta_before.push_back(Metric(*fleet.engines[i].client, "refit_delta_bytes_received_total"));
    }
    const double deltas_before = fleet.Sum("refit_delta_versions_total");
    fleet.Touch(v, 4096);
    PublishAndTime(fleet, v, site_b);
    fleet.CheckEngines(v);
    std::this_thread::sleep_for(milliseconds(500));
    REQUIRE(fleet.Sum("refit_delta_versions_total") - deltas_before == kEngines);
    double one_delta = 0;  // the most delta bytes one node of site b read (from anywhere)
    for (size_t k = 0; k < site_b.size(); ++k) {
      one_delta = std::max(
          one_delta, Metric(*fleet.engines[site_b[k]].client, "refit_delta_bytes_received_total") -
                         delta_before[k]);
    }
    const double wan = static_cast<double>(network->WanBytes()) - wan_before;
    const double crossed = SumOf(fleet, kSiteBytes, site_b) - site_before;
    std::printf(
        "sites, delta version %llu: one node's delta %.0f bytes; refit counted %.0f bytes "
        "crossing into b; the slow link carried %.0f bytes (control traffic included)\n",
        static_cast<unsigned long long>(v), one_delta, crossed, wan);
    INFO("delta " << one_delta << " bytes, crossed " << crossed << ", link " << wan);
    REQUIRE(one_delta > 0);
    // The payload crosses once; each node reads the delta's header (~2 KB per piece) from the
    // origin itself.
    REQUIRE(crossed <= 1.05 * one_delta + (site_b.size() - 1) * 4096.0);
    REQUIRE(wan < 0.05 * model);  // not full bytes, and not three deltas' payloads
  }
}

TEST_CASE("netns sites: a site name no one else has; a site whose engines all die mid-version",
          "[integration][netns][fanout][sites]") {
  auto network = MakeNetwork();
  // engine-4 is in site "c" alone (on site b's bridge).
  Fleet fleet(TwoSites(network.get(), 8192, {"a", "a", "b", "b", "c"}));  // 64 MiB
  const double model = static_cast<double>(fleet.ModelBytes());
  fleet.PublishAndCheck(1);
  fleet.PublishAndCheck(2);
  // The lone node reads everything across itself, and says so naming itself and its site.
  const std::string lone = fleet.LogOf("engine-4");
  INFO(lone.substr(lone.size() > 4000 ? lone.size() - 4000 : 0));
  REQUIRE(lone.find("node engine-4 is the only node of site 'c'") != std::string::npos);
  REQUIRE(Metric(*fleet.engines[4].client, kSiteBytes) >= 1.9 * model);
  // Kill both of site a's engine nodes while version 3 is on its way through them: site b's
  // nodes and engine-4 read what they owed from the trainer's node and complete bit-exact.
  Fill(*fleet.source, 3 * 7919);
  fleet.Publish(3);
  fleet.WaitMidVersion(0, 3);
  REQUIRE(fleet.engines[0].daemon->Stop(SIGKILL) == 128 + SIGKILL);
  REQUIRE(fleet.engines[1].daemon->Stop(SIGKILL) == 128 + SIGKILL);
  fleet.CheckEngines(3, {0, 1});
  // With no engine left in site a, the next version comes to b straight from the trainer's
  // node: still once across into b.
  const double site_before = SumOf(fleet, kSiteBytes, {2, 3});
  fleet.PublishAndCheck(4, {0, 1});
  std::this_thread::sleep_for(milliseconds(500));
  const double crossed = SumOf(fleet, kSiteBytes, {2, 3}) - site_before;
  INFO("crossed into b: " << crossed / model << " models");
  REQUIRE(crossed >= 0.95 * model);
  REQUIRE(crossed <= 1.05 * model);
  // A relay that failed is named in the warnings of the nodes that read from it.
  bool named = false;
  for (const char* node : {"engine-2", "engine-3", "engine-4"}) {
    const std::string log = fleet.LogOf(node);
    named = named || log.find("relay=engine-0") != std::string::npos ||
            log.find("relay=engine-1") != std::string::npos;
  }
  REQUIRE(named);
}

TEST_CASE(
    "netns sites: two nodes claiming to be a site's entry are named; every node of a "
    "site dead",
    "[integration][netns][fanout][sites]") {
  auto network = MakeNetwork();
  FleetOptions options = TwoSites(network.get(), 4096, {"a", "a", "b", "b", "b"});  // 32 MiB
  // engine-3 sees no other node of site b (test build: as a node whose view of its site
  // differs would), so it reads every stripe across itself while engine-2 and engine-4 read
  // theirs: two entries into b for those bytes.
  options.engine_env.resize(kEngines);
  options.engine_env[3] = {"REFIT_TEST_SITE_ALONE=1"};
  Fleet fleet(options);
  const double model = static_cast<double>(fleet.ModelBytes());
  const std::vector<size_t> site_b = {2, 3, 4};
  for (uint64_t v = 1; v <= 2; ++v) {
    const double site_before = SumOf(fleet, kSiteBytes, site_b);
    fleet.PublishAndCheck(v);  // complete and bit-exact everywhere
    std::this_thread::sleep_for(milliseconds(500));
    const double crossed = SumOf(fleet, kSiteBytes, site_b) - site_before;
    std::printf("sites, two entries into b, version %llu: %.3f models crossed into b\n",
                static_cast<unsigned long long>(v), crossed / model);
    INFO("version " << v << ": crossed " << crossed / model << " models");
    REQUIRE(crossed > 1.3 * model);  // what the warning is about: some bytes crossed twice
  }
  // Site a's relays, which serve site b across, counted and named the second entry.
  const double conflicts = Metric(*fleet.engines[0].client, "refit_site_entry_conflicts_total") +
                           Metric(*fleet.engines[1].client, "refit_site_entry_conflicts_total");
  REQUIRE(conflicts >= 1);
  bool named = false;
  for (const char* node : {"engine-0", "engine-1"}) {
    const std::string log = fleet.LogOf(node);
    const size_t at = log.find("two entries into site 'b'");
    if (at == std::string::npos) continue;
    const std::string line = log.substr(log.rfind('\n', at) + 1, 600);
    INFO(line);
    named = named || line.find("engine-3") != std::string::npos;
  }
  REQUIRE(named);
  // Every node of site b dies while version 3 is on its way into b: site a's nodes complete it
  // and take the next version as before, and the trainer's refitd lives on. (Until the
  // workaround in daemon/transport/ucx/ucx_tcp_purge.cc, the trainer's refitd aborted here 3 of 3
  // in UCX 1.13: "ucp_request.c:684 Assertion ... got REP message" under uct_tcp_ep_set_failed,
  // a wire-up reply to a node killed before it acknowledged the trainer's tcp connection.)
  Fill(*fleet.source, 3 * 7919);
  fleet.Publish(3);
  fleet.WaitMidVersion(2, 3);
  for (size_t i : site_b) REQUIRE(fleet.engines[i].daemon->Stop(SIGKILL) == 128 + SIGKILL);
  fleet.CheckEngines(3, site_b);
  fleet.PublishAndCheck(4, site_b);
  REQUIRE(fleet.trainer_node->running());
  REQUIRE(fleet.trainer->Status().ok());
}

}  // namespace refit
