#include "tests/testing/fleet.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "tests/testing/ports.h"

namespace refit::testing {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

constexpr int kNetnsPort = 7070;

absl::Status Run(const std::string& command) {
  const int rc = std::system((command + " >/dev/null 2>&1").c_str());
  if (rc == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("`", command, "` failed (", rc, ")"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Network>> Network::Create(const std::string& prefix, int nodes,
                                                         const std::string& rate,
                                                         const NetworkSites* sites) {
  std::unique_ptr<Network> net(new Network());
  // $REFIT_TEST_NETNS_PREFIX names whose namespaces these are (several people testing on one
  // machine); the pid keeps two runs apart.
  const char* owner = std::getenv("REFIT_TEST_NETNS_PREFIX");
  net->prefix_ = absl::StrCat(owner ? owner : "", owner ? "-" : "", prefix, "-", getpid() % 100000);
  const std::string sw = net->prefix_ + "-sw";
  const std::string tbf = " root tbf rate " + rate + " burst 256kb latency 20ms";
  std::vector<std::string> commands = {"ip netns add " + sw, "ip -n " + sw + " link set lo up",
                                       "ip -n " + sw + " link add br0 type bridge",
                                       "ip -n " + sw + " link set br0 up"};
  if (sites) {
    const std::string wan =
        " root tbf rate " + sites->wan_rate + " burst 256kb latency " + sites->wan_latency;
    commands.insert(
        commands.end(),
        {"ip -n " + sw + " link add br1 type bridge", "ip -n " + sw + " link set br1 up",
         "ip -n " + sw + " link add w0 type veth peer name w1",
         "ip -n " + sw + " link set w0 master br0", "ip -n " + sw + " link set w1 master br1",
         "ip -n " + sw + " link set w0 up", "ip -n " + sw + " link set w1 up",
         "ip netns exec " + sw + " tc qdisc replace dev w0" + wan,
         "ip netns exec " + sw + " tc qdisc replace dev w1" + wan});
  }
  for (const std::string& c : commands) {
    absl::Status s = Run(c);
    if (!s.ok()) return s;
    net->switch_made_ = true;
  }
  for (int i = 0; i < nodes; ++i) {
    const std::string ns = net->Namespace(i), p = absl::StrCat("p", i), n = absl::StrCat("n", i);
    const std::string ip = net->Ip(i);
    commands = {
        "ip netns add " + ns,
        "ip -n " + sw + " link add " + p + " type veth peer name " + n,
        "ip -n " + sw + " link set " + n + " netns " + ns,
        "ip -n " + ns + " link set " + n + " name eth0",
        "ip -n " + ns + " addr add " + ip + "/24 dev eth0",
        "ip -n " + ns + " link set lo up",
        "ip -n " + ns + " link set eth0 up",
        absl::StrCat("ip -n ", sw, " link set ", p, " master br",
                     sites && i < static_cast<int>(sites->site.size()) ? sites->site[i] : 0),
        "ip -n " + sw + " link set " + p + " up",
        "ip netns exec " + ns + " tc qdisc replace dev eth0" + tbf,
        "ip netns exec " + sw + " tc qdisc replace dev " + p + tbf};
    net->nodes_ = i + 1;
    for (const std::string& c : commands) {
      absl::Status s = Run(c);
      if (!s.ok()) return s;
    }
  }
  return net;
}

absl::Status Network::SetRate(int node, const std::string& rate) {
  const std::string tbf = " root tbf rate " + rate + " burst 256kb latency 20ms";
  absl::Status s = Run("ip netns exec " + Namespace(node) + " tc qdisc replace dev eth0" + tbf);
  if (!s.ok()) return s;
  return Run(absl::StrCat("ip netns exec ", prefix_, "-sw tc qdisc replace dev p", node, tbf));
}

Network::~Network() {
  for (int i = 0; i < nodes_; ++i) (void)Run("ip netns del " + Namespace(i));
  if (switch_made_) (void)Run("ip netns del " + prefix_ + "-sw");
}

uint64_t Network::WanBytes() const {
  uint64_t total = 0;
  for (const char* dev : {"w0", "w1"}) {
    const std::string command = absl::StrCat("ip netns exec ", prefix_, "-sw cat /sys/class/net/",
                                             dev, "/statistics/tx_bytes");
    FILE* f = popen(command.c_str(), "r");
    REQUIRE(f != nullptr);
    unsigned long long bytes = 0;
    const int got = fscanf(f, "%llu", &bytes);
    pclose(f);
    REQUIRE(got == 1);
    total += bytes;
  }
  return total;
}

std::string Network::Namespace(int node) const { return absl::StrCat(prefix_, "-n", node); }
std::string Network::Ip(int node) const { return absl::StrCat("10.77.0.", node + 1); }
std::vector<std::string> Network::In(int node) const {
  return {"/usr/sbin/ip", "netns", "exec", Namespace(node)};
}
std::vector<std::string> Network::Env(int node) const {
  (void)node;
  return {"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"};
}

std::unique_ptr<Network> RequireNetwork(const std::string& prefix, int nodes,
                                        const std::string& rate, const NetworkSites* sites) {
  auto network = Network::Create(prefix, nodes, rate, sites);
  if (!network.ok()) {
    FAIL("cannot create the network namespaces this test needs (root and iproute2): "
         << network.status().message());
  }
  return std::move(network).value();
}

void Fill(SharedMemory& shm, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* p = reinterpret_cast<uint64_t*>(shm.data());
  for (uint64_t i = 0; i < shm.size() / 8; ++i) p[i] = rng();
}

double Metric(client::Client& c, const std::string& name) {
  auto s = c.Status();
  REQUIRE(s.ok());
  auto it = s->metrics().find(name);
  return it == s->metrics().end() ? 0 : it->second;
}

std::string Fleet::Address(int node) const {
  if (options.network) return absl::StrCat(options.network->Ip(node), ":", kNetnsPort);
  return absl::StrCat("127.0.0.1:", ports_[node]);
}

Fleet::Fleet(FleetOptions opts) : options(std::move(opts)) {
  const int engine_count = options.engines;
  // Two trainer nodes in namespaces: the network has engines + 2 nodes (the second trainer's
  // node last).
  REQUIRE((options.trainers == 1 || options.trainers == 2));
  if (options.network && options.trainers == 2) {
    REQUIRE(options.network->Nodes() >= engine_count + 2);
  }
  // The daemons need each other's ports before they start (every engine lists every other one
  // in --peers): ports picked now, each one distinct.
  for (int i = 0; i <= engine_count + 1; ++i) ports_.push_back(options.network ? 0 : FreePort());
  std::vector<std::string> args = {"--node=trainer", "--listen=" + Address(0), "--retain=1"};
  // Network namespaces: veth addresses, plaintext by the test's choice (secure by default).
  if (options.network) args.push_back("--allow-plaintext-peers");
  args.insert(args.end(), options.trainer_args.begin(), options.trainer_args.end());
  auto t = DaemonProcess::Start(
      args, "", options.network ? options.network->Env(0) : std::vector<std::string>(),
      Wrapper(0, "trainer"));
  REQUIRE(t.ok());
  trainer_node = std::move(t).value();
  trainer = trainer_node->Connect().value();
  const uint64_t bytes = static_cast<uint64_t>(options.rows) * kFleetCols * 2;
  source =
      std::make_unique<SharedMemory>(SharedMemory::Create(UniqueShmName("fan-src"), bytes).value());
  if (options.trainers == 1) {
    auto id =
        trainer->RegisterBuffer("m", v1::SOURCE, source->name(),
                                {Slice("w", v1::BF16, {options.rows, kFleetCols}, 0)}, "trainer");
    REQUIRE(id.ok());
    source_id = *id;
  } else {
    std::vector<std::string> second = {"--node=trainer-1", "--listen=" + Address(engine_count + 1),
                                       "--retain=1"};
    if (options.network) second.push_back("--allow-plaintext-peers");
    second.insert(second.end(), options.trainer_args.begin(), options.trainer_args.end());
    auto t2 = DaemonProcess::Start(
        second, "",
        options.network ? options.network->Env(engine_count + 1) : std::vector<std::string>(),
        Wrapper(engine_count + 1, "trainer-1"));
    REQUIRE(t2.ok());
    second_trainer_node = std::move(t2).value();
    second_trainer = second_trainer_node->Connect().value();
    const int64_t half = options.rows / 2;
    for (int r = 0; r < 2; ++r) {
      shards.push_back(std::make_unique<SharedMemory>(
          SharedMemory::Create(UniqueShmName("fan-shard"), bytes / 2).value()));
      client::Client& c = r == 0 ? *trainer : *second_trainer;
      auto id = c.RegisterBuffer(
          "m", v1::SOURCE, shards[r]->name(),
          {Slice("w", v1::BF16, {options.rows, kFleetCols}, 0, {r * half, 0}, {half, kFleetCols})},
          "trainer-" + std::to_string(r));
      REQUIRE(id.ok());
      shard_ids.push_back(*id);
    }
  }
  engines.resize(engine_count);
  for (int i = 0; i < engine_count; ++i) {
    FleetEngine& e = engines[i];
    e.half = i < static_cast<int>(options.half.size()) && options.half[i];
    std::string peers = "--peers=" + Address(0);
    if (options.trainers == 2) peers += "," + Address(engine_count + 1);
    for (int j = 0; j < engine_count && !options.peers_trainer_only; ++j) {
      if (j != i) peers += "," + Address(j + 1);
    }
    e.args = {"--node=engine-" + std::to_string(i), "--listen=" + Address(i + 1), peers,
              "--retain=1"};
    if (options.network) e.args.push_back("--allow-plaintext-peers");
    if (i < static_cast<int>(options.engine_args.size())) {
      e.args.insert(e.args.end(), options.engine_args[i].begin(), options.engine_args[i].end());
    }
    if (options.network) e.env = options.network->Env(i + 1);
    if (i < static_cast<int>(options.engine_env.size())) {
      e.env.insert(e.env.end(), options.engine_env[i].begin(), options.engine_env[i].end());
    }
    StartEngine(i);
  }
  WaitForFleet();
}

void Fleet::StartEngine(size_t i) {
  FleetEngine& e = engines[i];
  auto d = DaemonProcess::Start(e.args, "", e.env,
                                Wrapper(static_cast<int>(i) + 1, "engine-" + std::to_string(i)));
  REQUIRE(d.ok());
  e.daemon = std::move(d).value();
  e.client = e.daemon->Connect().value();
  const int64_t rows = options.rows;
  const int64_t first = e.half ? rows / 2 : 0, count = e.half ? rows / 2 : rows;
  e.memory = std::make_unique<SharedMemory>(
      SharedMemory::Create(UniqueShmName("fan-dst"), count * kFleetCols * 2).value());
  auto buffer = e.client->RegisterBuffer(
      "m", v1::DESTINATION, e.memory->name(),
      {Slice("w", v1::BF16, {rows, kFleetCols}, 0, {first, 0}, {count, kFleetCols})},
      "engine-" + std::to_string(i));
  REQUIRE(buffer.ok());
  e.buffer = *buffer;
}

void Fleet::RestartEngine(size_t i) {
  engines[i].client.reset();
  engines[i].daemon->Stop(SIGKILL);
  engines[i].daemon.reset();
  StartEngine(i);
}

void Fleet::WaitForFleet() {
  const size_t n = engines.size();
  for (int round = 0; round < 600; ++round) {
    bool ready = true;
    for (FleetEngine& e : engines) {
      auto s = e.client->Status();
      REQUIRE(s.ok());
      int connected = 0;
      for (const auto& p : s->peers()) connected += p.connected();
      size_t replicas = 0;
      for (const auto& m : s->models()) {
        if (m.model() == "m") replicas = static_cast<size_t>(m.replicas_size());
      }
      const int peers =
          (options.peers_trainer_only ? 0 : static_cast<int>(n) - 1) + options.trainers;
      ready = ready && connected == peers && replicas == n;
    }
    for (client::Client* t : {trainer.get(), second_trainer.get()}) {
      if (!t) continue;
      auto ts = t->Status();
      REQUIRE(ts.ok());
      for (const auto& m : ts->models()) {
        if (m.model() == "m") ready = ready && static_cast<size_t>(m.replicas_size()) == n;
      }
    }
    if (ready) return;
    std::this_thread::sleep_for(milliseconds(50));
  }
  FAIL("the fleet did not connect and report replicas");
}

void Fleet::Publish(uint64_t version) {
  if (options.trainers == 1) {
    REQUIRE(trainer->Publish("m", version, {source_id}).ok());
    return;
  }
  const uint64_t half = source->size() / 2;
  for (int r = 0; r < 2; ++r) {
    std::memcpy(shards[r]->data(), source->data() + r * half, half);
    REQUIRE((r == 0 ? *trainer : *second_trainer).Publish("m", version, {shard_ids[r]}).ok());
  }
}

void Fleet::PublishAndCheck(uint64_t version, const std::vector<size_t>& skip) {
  Fill(*source, version * 7919);
  Publish(version);
  CheckEngines(version, skip);
}

void Fleet::CheckEngines(uint64_t version, const std::vector<size_t>& skip, milliseconds timeout) {
  for (size_t i = 0; i < engines.size(); ++i) {
    if (std::find(skip.begin(), skip.end(), i) != skip.end()) continue;
    FleetEngine& e = engines[i];
    INFO("engine-" << i << ", version " << version);
    auto got = e.client->WaitForVersion("m", version, timeout);
    REQUIRE(got.ok());
    REQUIRE(*got == version);
    REQUIRE(e.client->Apply("m", version, {e.buffer}).ok());
    const uint64_t offset = e.half ? ModelBytes() / 2 : 0;
    REQUIRE(std::memcmp(e.memory->data(), source->data() + offset, e.memory->size()) == 0);
  }
}

void Fleet::Touch(uint64_t seed, uint64_t stride) {
  std::mt19937_64 rng(seed);
  auto* p = reinterpret_cast<uint16_t*>(source->data());
  for (uint64_t i = rng() % stride; i < ModelBytes() / 2; i += stride) {
    p[i] = static_cast<uint16_t>(rng());
  }
}

void Fleet::WaitMidVersion(size_t i, uint64_t version, double from, double to) {
  bool mid = false;
  for (int round = 0; round < 5000 && !mid; ++round) {
    auto s = engines[i].client->Status();
    REQUIRE(s.ok());
    for (const auto& t : s->transfers()) {
      const double total = static_cast<double>(t.bytes_total());
      const double done = static_cast<double>(t.bytes_done());
      mid = mid || (t.version() == version && done > from * total && done < to * total);
    }
    if (!mid) std::this_thread::sleep_for(milliseconds(2));
  }
  INFO("engine-" << i << ", version " << version << ": between " << from << " and " << to);
  REQUIRE(mid);
}

Fleet::HalvesSent Fleet::PublishAndCheckHalves(uint64_t version) {
  REQUIRE(options.trainers == 2);
  const char* sent = "refit_data_bytes_sent_total";
  const double first_before = Metric(*trainer, sent);
  const double second_before = Metric(*second_trainer, sent);
  const double relayed_before = RelaySent();
  PublishAndCheck(version);
  std::this_thread::sleep_for(milliseconds(500));  // the pins' releases count the bytes
  const double half = static_cast<double>(ModelBytes()) / 2;
  HalvesSent out;
  out.first = (Metric(*trainer, sent) - first_before) / half;
  out.second = (Metric(*second_trainer, sent) - second_before) / half;
  out.relayed = (RelaySent() - relayed_before) / half;
  std::printf(
      "two trainer nodes, version %llu: each sent %.3f and %.3f of its half, the relays %.3f "
      "halves\n",
      static_cast<unsigned long long>(version), out.first, out.second, out.relayed);
  return out;
}

double Fleet::Sum(const std::string& metric, const std::vector<size_t>& skip) {
  double total = 0;
  for (size_t i = 0; i < engines.size(); ++i) {
    if (std::find(skip.begin(), skip.end(), i) != skip.end()) continue;
    if (engines[i].daemon->running()) total += Metric(*engines[i].client, metric);
  }
  return total;
}

std::vector<std::string> Fleet::Wrapper(int node, const std::string& name) const {
  std::vector<std::string> out =
      options.network ? options.network->In(node) : std::vector<std::string>();
  if (!options.log_dir.empty()) {
    out.insert(out.end(),
               {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>>" + options.log_dir + "/" + name + ".log"});
  }
  return out;
}

std::string Fleet::LogOf(const std::string& node) const {
  std::ifstream in(options.log_dir + "/" + node + ".log");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

double Fleet::RelaySent() { return Sum("refit_relay_bytes_sent_total"); }

}  // namespace refit::testing
