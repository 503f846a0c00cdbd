#pragma once

// Everything refitd can be told, from flags (main.cc) and the config file (daemon/config).

#include <cstdint>
#include <string>
#include <vector>

namespace refit {

struct DaemonOptions {
  std::string socket_path = "/run/refit/refitd.sock";
  std::string listen = "127.0.0.1:7070";  // HOST:PORT for other daemons; port 0 picks one
  std::vector<std::string> peers;
  std::string node;
  uint32_t retain = 2;
  std::string log_level = "info";
  std::string metrics_listen;         // HOST:PORT for Prometheus /metrics; empty: off
  std::string health_listen;          // HOST:PORT for grpc.health.v1 alone (probes); empty: off
  uint64_t chunk_bytes = 4ull << 20;  // largest single RMA read of a pull
  uint32_t inflight = 16;             // RMA reads in flight per pull
  // Largest single read of what this node reads from a stripe's origin to relay to others.
  uint64_t relay_chunk_bytes = 256ull << 10;
  // Delta sync: a delta bigger than this fraction of the full bytes is not used (0: deltas
  // off); a source keeps the newest `delta_chain` deltas of each piece.
  double delta_threshold = 0.5;
  uint32_t delta_chain = 4;
  // An engine node's delta base: "held" (a held copy of the newest version), "destination"
  // (the DESTINATION buffers its last Apply filled; the held copy is released), or per model,
  // e.g. "policy=destination,critic=held" (Store's ParseDeltaBase; checked at start).
  std::string delta_base = "held";
  // The storage-bucket path (daemon/bucket): write versions of local SOURCE models to
  // bucket_export, with a full base every bucket_full_every versions; follow bucket_import.
  std::string bucket_export;
  std::string bucket_import;
  uint32_t bucket_full_every = 8;
  // Version slots: "host" (pinned when a GPU is seen) or "cuda" (on GPU slot_device).
  std::string slot_memory = "host";
  int slot_device = 0;
  // Most bytes of version slots (published, pulled, being pulled or kept for reuse) in host
  // memory; 0: no limit. Past it Publish answers RESOURCE_EXHAUSTED and pulls are abandoned.
  uint64_t max_slot_memory = 0;
  // The same for slots in GPU memory (--slot-memory=cuda), which max_slot_memory does not count.
  uint64_t max_gpu_slot_memory = 0;
  // Fan-out: serve what this node pulled to other nodes pulling the same version, and read
  // from them (daemon/fleet); false: every byte comes from the node that published it.
  bool relay = true;
  // Bounded peer connections: the most control channels this daemon keeps open to other
  // daemons. --peers are always connected; relay channels (the stripe parents this node reads
  // from) open on demand while the total is below it, and close after a minute idle.
  uint32_t max_peer_connections = 16;
  // Sites: nodes given the same --site relay versions among themselves; each version enters a
  // site once (its stripes read across from the origin's site, then relayed inside). "": none.
  std::string site;
  // Local callers (SO_PEERCRED) allowed on --socket besides the daemon's own uid; empty
  // allow_gids: the socket's group. Others get PERMISSION_DENIED on every RPC, health included.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  // Long-lived local calls (Watch, WaitForVersion, WaitForReplicas, health Watch) open at once:
  // per client process, per uid, in all; past them RESOURCE_EXHAUSTED (daemon/callers).
  uint32_t max_waiting_calls_per_process = 32;
  uint32_t max_waiting_calls_per_uid = 256;
  uint32_t max_waiting_calls = 1024;
  // No new local gRPC server is built while refitd runs this many threads.
  uint32_t max_local_threads = 4096;
  // Local connections that have not sent their first bytes (the HTTP/2 preface, or refit's fd
  // passing) yet, per uid; past it new ones of that uid are closed.
  uint32_t max_unspoken_connections_per_uid = 32;
  // Mutual TLS on the peer plane (PEM paths; all three or none).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  // Without TLS, a --listen that is not a loopback address stops the start unless this is set
  // (tls::CheckPeerPlaneExposure): the peer plane would be open to any host that reaches it.
  bool allow_plaintext_peers = false;
  // Where refitd keeps what outlives a restart (each model's newest published version); empty:
  // nowhere (main.cc defaults it to $STATE_DIRECTORY).
  std::string state_dir;
  // UCX's tcp listening ports ("LOW-HIGH", UCX_TCP_PORT_RANGE); empty: any port.
  std::string data_ports;
};

}  // namespace refit
