#pragma once

// The conformance suite every Transport backend passes (tensorstore's register.h, gloo's
// per-transport tests). transport_conformance.cc holds the Catch2 test cases; a test binary
// links it (alwayslink) and defines TestBackend() to say which backend, in which setting, they
// run against:
//
//   const ConformanceBackend& TestBackend() {
//     static const ConformanceBackend backend{"ucx-tcp", [] { ... }, true, true, nullptr};
//     return backend;
//   }
//
// Single-process cases run two or three transports in the test process and poll all of them.
// Cross-process cases (cross_process) fork PeerProcess children at the start of the case, before
// the test creates its own transport, and kill them with SIGKILL to test peer failure.

#include <functional>
#include <string>

#include "daemon/transport/testing/peer_process.h"
#include "daemon/transport/transport.h"

namespace refit::transport {

struct ConformanceBackend {
  std::string name;
  TransportFactory make;
  // Transports in different processes can talk (fork-based cases run).
  bool cross_process = false;
  // A killed peer fails ops with UNAVAILABLE (false only for UCX without peer-failure handling,
  // whose failure cases are skipped).
  bool detects_peer_failure = true;
  // Makes `peer` behave like a crashed process, in this process; null when only a real kill
  // does (the cross-process cases cover that).
  std::function<void(Transport& peer)> crash;
  // A peer process's AllocateMemory memory is mapped here on import (RemoteMemory::mapped()).
  bool maps_peer_memory = false;
  // Ops still complete (with errors for the dead peer) after a peer was killed mid-transfer
  // (false: UCX 1.13 shared memory with error handling, whose receive FIFO a killed writer can
  // leave stuck, so that neither the dead peer's ops nor other peers' ever complete).
  bool survives_killed_writer = true;
};

// Defined by each conformance test binary.
const ConformanceBackend& TestBackend();

}  // namespace refit::transport
