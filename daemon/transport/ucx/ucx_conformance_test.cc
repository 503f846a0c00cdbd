// The conformance suite against the UCX backend. The BUILD target picks the UCX transports with
// UCX_TLS in the test's environment; REFIT_TEST_UCX_PEER_FAILURE=0 runs it without peer-failure
// handling (what UCX 1.13's shared-memory transports need), which skips the failure cases.
// REFIT_TEST_UCX_MAPPED=1 expects memory a peer process allocated through its transport to be
// mapped here (UCX shared memory), so that gets and puts on it are plain memcpy. With
// UCX_POSIX_ERROR_HANDLING set (shared memory with peer-failure handling) the case of a peer
// killed mid-transfer is skipped: see ucx_transport.h (the idle-peer death case still runs).

#include <cstdlib>
#include <cstring>
#include <string>

#include "daemon/transport/testing/transport_conformance.h"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit::transport {
namespace {

bool PeerFailureHandling() {
  const char* v = std::getenv("REFIT_TEST_UCX_PEER_FAILURE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// REFIT_TEST_UCX_MAPPED=1: the BUILD target's UCX_TLS includes shared memory, so a peer's
// transport-allocated memory must be mapped (the zero-copy path).
bool ExpectMapped() {
  const char* v = std::getenv("REFIT_TEST_UCX_MAPPED");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace

const ConformanceBackend& TestBackend() {
  static const ConformanceBackend backend{
      std::string("ucx UCX_TLS=") + (std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "(all)") +
          (PeerFailureHandling() ? "" : " without peer-failure handling"),
      []() -> absl::StatusOr<std::unique_ptr<Transport>> {
        UcxTransport::Options options;
        options.peer_failure_handling = PeerFailureHandling();
        auto transport = UcxTransport::Create(options);
        if (!transport.ok()) return transport.status();
        return std::unique_ptr<Transport>(std::move(*transport));
      },
      /*cross_process=*/true,
      /*detects_peer_failure=*/PeerFailureHandling(),
      nullptr,
      /*maps_peer_memory=*/ExpectMapped(),
      /*survives_killed_writer=*/std::getenv("UCX_POSIX_ERROR_HANDLING") == nullptr};
  return backend;
}

}  // namespace refit::transport
