#pragma once

// A fluid, event-driven model of a fleet pulling one version through the stripe trees of
// daemon/fleet/stripes.h, so that fan-out to hundreds of nodes can be measured without them.
//
// What is modelled: nodes with an uplink and a downlink (bytes/s) and a one-way latency;
// pieces (one trainer rank's snapshot) on their origin nodes, cut into chunks; every routing
// decision (how many stripes, which stripe a chunk is in, whose child a node is) comes from
// StripeCount / StripeOf / PieceSalt / ParentFor, as in the daemon's pull. The child pulls:
// it learns what its parent holds (one latency after the chunk landed there), requests it (one
// latency), the bytes flow, and the chunk lands one latency after its last byte left. A node
// has at most `inflight` chunk reads outstanding per parent. Transfers share their sender's
// uplink and their receiver's downlink max-min fair (progressive filling), recomputed whenever
// a transfer starts or ends. Between one sender and one receiver the transfers are either one
// ordered stream (a connection: reads queued on it are served in order, and the stream counts
// once in the sharing) or each a flow of its own (see SimScenario::pair_sharing). A killed node
// drops its transfers; after `detect_delay_s` the nodes below it re-source whatever they still
// lack from the piece's origin.
//
// Not modelled: the core network (only access links limit), TCP/UCX ramp-up and loss, CPU,
// memory copies and checksum time, the bandwidth of control traffic (it has latency only).
// docs/fanout-simulator.md describes the model and what it predicts.
//
// Pure and single-threaded: Simulate() owns all of its state; any thread may call it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace refit::fleet {

struct SimNode {
  std::string name;  // Node names order the stripe trees, as in the daemon.
  double up_bytes_per_s = 0;
  double down_bytes_per_s = 0;
  // Half the one-way latency of a message between two nodes: a message from a to b takes
  // a.latency_s + b.latency_s.
  double latency_s = 0;
};

struct SimPiece {
  std::string buffer_id;  // With the origin's name, the stripe salt (PieceSalt).
  int origin = 0;         // Index into SimScenario::nodes.
  uint64_t bytes = 0;
  std::vector<int> pullers;  // Indices of the nodes that pull this piece.
};

struct SimKill {
  int node = 0;
  double time_s = 0;
};

// Who re-sources from the origin when a relay dies.
enum class Failover {
  kChildren,  // The dead node's children in the stripe trees; deeper nodes keep their parents.
  kSubtree,   // Every node whose path in the stripe's tree passed through the dead node.
};

// How the chunk transfers between one sender and one receiver share that pair's bandwidth.
enum class PairSharing {
  kInOrder,  // One stream per pair, served in request order (one TCP connection per peer).
  kFair,     // Every transfer is a flow of its own, fair-shared with all the others.
};

struct SimScenario {
  std::vector<SimNode> nodes;
  std::vector<SimPiece> pieces;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  int fanout = 8;
  int inflight = 16;  // Chunk reads outstanding per (child, parent).
  bool relay = true;  // false: every puller reads every chunk from the origin (no trees).
  double detect_delay_s = 0.2;
  Failover failover = Failover::kChildren;
  PairSharing pair_sharing = PairSharing::kInOrder;
  std::vector<SimKill> kills;
};

struct SimNodeResult {
  uint64_t bytes_sent = 0;      // Bytes of chunks that landed at their receiver.
  uint64_t bytes_received = 0;  // Bytes of chunks that landed here.
  uint64_t bytes_aborted = 0;   // Bytes this node sent in transfers cut by a kill.
  uint64_t chunks_sent = 0;
  double done_s = -1;  // When this node held every chunk it pulls; -1 if never (or dead).
  bool killed = false;
};

struct SimResult {
  double time_s = 0;  // Until every live puller held every chunk it pulls.
  std::vector<SimNodeResult> nodes;
  uint64_t transfers = 0;  // Chunk transfers that landed.
  uint64_t events = 0;
};

// Runs the scenario to completion. INVALID_ARGUMENT for a malformed scenario (bad indices,
// a puller that is its own origin, a killed origin, zero bandwidth); FAILED_PRECONDITION if
// some live puller can never complete.
[[nodiscard]] absl::StatusOr<SimResult> Simulate(const SimScenario& scenario);

// A uniform fleet: `trainers` origin nodes with `pieces_per_trainer` pieces each (the model's
// bytes split evenly over all pieces), and `engines` pullers. With `replicas` > 0 the engines
// form that many replicas, each holding a shard of the model (engines / replicas nodes per
// replica): piece p is pulled by shard p % (engines / replicas) of every replica. With
// `replicas` == 0 every engine pulls every piece (a full copy per node).
struct FleetSpec {
  int trainers = 1;
  int pieces_per_trainer = 1;
  int engines = 1;
  int replicas = 0;
  uint64_t model_bytes = uint64_t{256} << 20;
  double link_bytes_per_s = 1e9 / 8;  // Each node's uplink and downlink.
  double latency_s = 100e-6;          // One-way, node to node.
};

// Node 0 .. trainers-1 are "trainer-NN", then "engine-NNN".
[[nodiscard]] absl::StatusOr<SimScenario> MakeFleet(const FleetSpec& spec);

// The index of a node that relays stripe 0 of piece 0 to the most descendants (the root of
// that stripe's tree), or -1 when no puller relays anything (one puller, or relay off).
int BusiestRelay(const SimScenario& scenario);

}  // namespace refit::fleet
