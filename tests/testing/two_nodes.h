#pragma once

// Two or three refitd processes on this machine acting as nodes, and the buffers their clients
// register: what tests/two_node_test and tests/two_node_liveness_test share.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/ports.h"

namespace refit::testing {

client::SharedMemory MakeShm(uint64_t size);
// Random words from `seed` over the whole buffer.
void FillRandom(client::SharedMemory& shm, uint32_t seed);
// The daemon's peer (gRPC) port.
int ListenPort(const DaemonProcess& d);
// Waits until `client`'s daemon reports every peer connected.
void WaitConnected(client::Client& client, int peers);
// Waits (up to 10 s) until `client`'s daemon has pulled some bytes of `version`.
void WaitPulling(client::Client& client, uint64_t version);
// Whether UCX_TLS names shared memory (the *_shm_test variants).
bool SharedMemoryTls();

// A trainer's node and an engine's node (--peers = the trainer's), connected, with a client
// to each.
struct TwoNodes {
  TwoNodes();
  std::unique_ptr<DaemonProcess> trainer_node, engine_node;
  std::unique_ptr<client::Client> trainer, engine;
};

// The same, started with extra environment for the source and flags for the engine.
struct Pair {
  std::unique_ptr<DaemonProcess> source, engine;
  std::unique_ptr<client::Client> trainer, inference;
};
Pair StartSourceAndEngine(const std::vector<std::string>& source_env = {},
                          const std::vector<std::string>& engine_args = {});

struct Registered {
  std::unique_ptr<client::Client> client;
  std::string id;
};
// A buffer of `elements` bytes registered whole as one uint8 tensor "w" of model "big".
Registered RegisterWhole(DaemonProcess& daemon, v1::Role role, const client::SharedMemory& shm,
                         int64_t elements);

// One `bytes`-sized tensor of model "big": a SOURCE on `source`, a DESTINATION on `engine`,
// whose daemon is connected to its one peer.
struct BigModel {
  BigModel(DaemonProcess& source, DaemonProcess& engine, int64_t bytes);
  // Fills the source buffer with `value` and publishes it as `version`.
  void Publish(uint64_t version, int value);
  bool DestinationIs(uint8_t value) const;
  int64_t bytes;
  client::SharedMemory src, dst;
  Registered trainer, inference;
};

}  // namespace refit::testing
