#pragma once

// One trainer's node and several engine nodes, each a real refitd process, for the fan-out
// tests (relays, replicas). The daemons run on loopback, or (with a Network) each in its own
// network namespace on one bridge, each node's link throttled with tc tbf in both directions,
// so a version takes long enough to be caught mid-flight.
//
// Not thread-safe; one test thread owns a Fleet. Failures are Catch2 REQUIRE/FAIL.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit::testing {

// Network namespaces `<prefix>-<tag>-sw` (a bridge), `<prefix>-<tag>-n0` .. `-n<nodes-1>`
// (node i's end of a veth pair, eth0, 10.77.0.<i+1>/24), each veth end limited to `rate` (tc
// tbf syntax, e.g. "200mbit") on both sides. `tag` is this process's pid, so tests running
// at the same time don't collide. Everything is removed on destruction.
// Two sites: node i hangs off bridge br<site[i]> (0 or 1); the two bridges are joined inside the
// switch namespace by one veth pair (w0 on br0, w1 on br1), limited to `wan_rate` each way.
struct NetworkSites {
  std::vector<int> site;
  std::string wan_rate = "100mbit";
  // The slow link's queue (tbf latency): deep enough that the flows crossing it together are
  // not dropped into TCP retransmits, which the link's counters would count again.
  std::string wan_latency = "400ms";
};

class Network {
 public:
  // An error (the failing command) where namespaces can't be made (not root, no iproute2).
  static absl::StatusOr<std::unique_ptr<Network>> Create(const std::string& prefix, int nodes,
                                                         const std::string& rate,
                                                         const NetworkSites* sites = nullptr);
  // With sites: the bytes that crossed the link between them, both ways (w0 and w1 transmit
  // counters, Ethernet frames: everything, control traffic included).
  uint64_t WanBytes() const;
  ~Network();

  std::string Ip(int node) const;
  int Nodes() const { return nodes_; }
  std::string SwitchNamespace() const { return prefix_ + "-sw"; }
  // Node i's link (both directions) limited to `rate` from now on (tc tbf syntax).
  absl::Status SetRate(int node, const std::string& rate);
  // The command prefix that runs a program in node i's namespace.
  std::vector<std::string> In(int node) const;
  // What node i's daemon needs in its environment (UCX over eth0 only).
  std::vector<std::string> Env(int node) const;

 private:
  Network() = default;
  std::string Namespace(int node) const;
  std::string prefix_;
  int nodes_ = 0;
  bool switch_made_ = false;
};

// Network::Create, or the test FAILs saying why (root and iproute2 are needed): a netns test is
// never silently green. The namespaces' prefix is `prefix`, after $REFIT_TEST_NETNS_PREFIX.
std::unique_ptr<Network> RequireNetwork(const std::string& prefix, int nodes,
                                        const std::string& rate,
                                        const NetworkSites* sites = nullptr);

// A bf16 value stream from `seed`, over all of `shm`.
void Fill(client::SharedMemory& shm, uint64_t seed);

// Node `client`'s metric `name` (0 when it has none yet).
double Metric(client::Client& client, const std::string& name);

struct FleetEngine {
  std::unique_ptr<DaemonProcess> daemon;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::SharedMemory> memory;
  std::string buffer;
  bool half = false;
  std::vector<std::string> args;  // what it was started with, to restart it
  std::vector<std::string> env;
};

struct FleetOptions {
  int engines = 4;
  int64_t rows = 8192;  // one bf16 tensor [rows, kFleetCols]: 64 MiB by default
  // Engine i holds the second half of the rows (a TP2 rank) instead of all of them.
  std::vector<bool> half;
  std::vector<std::vector<std::string>> engine_args;  // more flags for engine i
  std::vector<std::vector<std::string>> engine_env;   // more environment for engine i
  std::vector<std::string> trainer_args;              // more flags for the trainer's node
  Network* network = nullptr;                         // null: loopback
  // Bounded peer connections: each engine's --peers names only the trainer's node (it learns
  // the other engines from the trainer's answers to its replica reports); else every engine
  // lists every other daemon.
  bool peers_trainer_only = false;
  // 2: a second trainer's node ("trainer-1"; in a network, its last node: engines + 2 nodes);
  // each trainer node publishes half the rows of the tensor (a TP2 trainer), and every
  // engine's --peers names both.
  int trainers = 1;
  // Non-empty: each daemon's stderr (its log) goes to <log_dir>/<node>.log (LogOf).
  std::string log_dir;
};

inline constexpr int64_t kFleetCols = 4096;

class Fleet {
 public:
  explicit Fleet(FleetOptions options);

  // Every engine connected to every other daemon (the trainer only, with peers_trainer_only)
  // and knowing every live engine as a replica,
  // and the trainer knowing them all: relaying is possible from the next version on.
  void WaitForFleet();

  uint64_t ModelBytes() const { return source->size(); }

  // Publishes what `source` holds as `version`.
  void Publish(uint64_t version);
  // Publishes `version` (every byte changed), and checks that every live engine completes it
  // and holds exactly the trainer's bytes after Apply.
  void PublishAndCheck(uint64_t version, const std::vector<size_t>& skip = {});
  void CheckEngines(uint64_t version, const std::vector<size_t>& skip = {},
                    std::chrono::milliseconds timeout = std::chrono::milliseconds(120000));

  // Changes one bf16 element in every `stride` of `source` (from `seed`): a small delta of the
  // last version.
  void Touch(uint64_t seed, uint64_t stride);

  // Waits until engine i's transfer of `version` holds more than `from` and less than `to` of
  // the version's bytes (fractions), so that what happens next happens mid-version; REQUIREs
  // that it got there within ~10 s.
  void WaitMidVersion(size_t i, uint64_t version, double from = 0, double to = 1);

  // Two trainer nodes: what each sent of its half (refit_data_bytes_sent_total) and what the
  // relays sent, in halves of the model, while `version` was published and checked everywhere.
  struct HalvesSent {
    double first = 0, second = 0, relayed = 0;
  };
  HalvesSent PublishAndCheckHalves(uint64_t version);

  // Kills engine i (SIGKILL) and starts it again with the same flags and a fresh destination
  // buffer (it holds no version then).
  void RestartEngine(size_t i);

  // refit_relay_bytes_sent_total summed over the live engines.
  double RelaySent();
  // What node `node` ("trainer", "engine-0", ...) logged so far (options.log_dir).
  std::string LogOf(const std::string& node) const;
  double Sum(const std::string& metric, const std::vector<size_t>& skip = {});

  FleetOptions options;
  std::unique_ptr<DaemonProcess> trainer_node;
  std::unique_ptr<client::Client> trainer;
  std::vector<FleetEngine> engines;
  // The whole model as the trainer publishes it (Fill and Touch write here; engines are
  // checked against it). With two trainer nodes, Publish copies each half into its node's shard.
  std::unique_ptr<client::SharedMemory> source;
  std::string source_id;
  std::unique_ptr<DaemonProcess> second_trainer_node;  // options.trainers == 2
  std::unique_ptr<client::Client> second_trainer;
  std::vector<std::unique_ptr<client::SharedMemory>> shards;  // per trainer node
  std::vector<std::string> shard_ids;

 private:
  void StartEngine(size_t i);
  // The command prefix that starts node `node` (0: the trainer) named `name`.
  std::vector<std::string> Wrapper(int node, const std::string& name) const;
  std::string Address(int node) const;  // host:port of node 0 (trainer) .. engines
  std::vector<int> ports_;
};

}  // namespace refit::testing
