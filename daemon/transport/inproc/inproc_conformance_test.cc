// The conformance suite against the in-process backend.

#include "daemon/transport/inproc/inproc_transport.h"
#include "daemon/transport/testing/transport_conformance.h"

namespace refit::transport {

const ConformanceBackend& TestBackend() {
  static const ConformanceBackend backend{
      "inproc",
      []() -> absl::StatusOr<std::unique_ptr<Transport>> { return InprocTransport::Create(); },
      /*cross_process=*/false,
      /*detects_peer_failure=*/true,
      [](Transport& peer) { static_cast<InprocTransport&>(peer).SimulateCrash(); },
      /*maps_peer_memory=*/false,
      /*survives_killed_writer=*/true};
  return backend;
}

}  // namespace refit::transport
