#pragma once

// gRPC's own log lines (gpr_log, ERROR and above by default) into refit's "grpc" logger, in
// refit's format. A TLS handshake a peer failed on the peer port (a plaintext peer, a
// certificate this node's --tls-ca does not accept, an expired one) is explained once and then
// said at most once a minute per reason with a count, instead of a raw line per attempt
// (a misconfigured peer retries several times a second); the server-name line gRPC logs for
// every TLS connection dialled by address is debug.
//
// Thread-safety: RouteGrpcLogs is called once, before gRPC starts; the routed function may be
// called from any thread.

namespace refit::tls {

void RouteGrpcLogs();

}  // namespace refit::tls
