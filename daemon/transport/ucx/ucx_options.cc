// UcxTransport's options: the UCX settings it applies by default, and which UCX_TLS values
// allow UCX RMA (ucx_transport.h, "Options::rma").

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "daemon/transport/ucx/ucx_internal.h"

namespace refit::transport {

// Whether a UCX_TLS value names only transports with hardware RMA (InfiniBand/RoCE rc and dc,
// with their aliases), so that no software RMA carries raw addresses: "rc,dc_x" yes; unset,
// "all", "^..." (everything but), tcp, shared memory, ud or cma no.
bool HardwareRmaOnly(const char* tls) {
  if (tls == nullptr || *tls == '\0' || *tls == '^') return false;
  const std::string list = tls;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string name = list.substr(start, comma - start);
    if (name.rfind("rc", 0) != 0 && name.rfind("dc", 0) != 0) return false;
    start = comma + 1;
  }
  return true;
}

// tcp's send and receive segment (DefaultConfig): a 1 MiB gather reply and its headers in one.
constexpr const char* kTcpSegment = "2m";

bool RdmaDevicesPresent() {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/class/infiniband", error)) {
    (void)entry;
    return true;
  }
  return false;
}

std::vector<std::pair<std::string, std::string>> UcxTransport::Options::DefaultConfig() {
  // Notice a dead peer on an idle connection within seconds rather than UCX's default 20 s.
  // Shared memory with peer-failure handling (UCX_POSIX_ERROR_HANDLING / _SYSV_) stays the
  // operator's choice: see ucx_transport.h for what a peer killed mid-transfer can do to it.
  std::vector<std::pair<std::string, std::string>> config = {{"KEEPALIVE_INTERVAL", "1s"}};
  const char* tls = std::getenv("UCX_TLS");
  const std::string list = tls ? tls : "";
  const bool excluding = !list.empty() && list[0] == '^';  // "^a,b": all but a and b
  const bool names_tcp = list.find("tcp") != std::string::npos;
  const bool all = list.empty() || list.find("all") != std::string::npos;
  const bool tcp_may_run = all || (excluding ? !names_tcp : names_tcp);
  // TCP: no zero-copy sends. UCX 1.13's tcp transport completes a zero-copy send twice when
  // the socket fails under it (uct_tcp_ep_sendv: uct_tcp_ep_handle_send_err has already purged
  // the send, then sendv completes it again), and its assertion aborts the process: a peer
  // SIGKILLed while a gather reply to it was half-written took the serving daemon with it
  // ("uct_iface.h:884 Assertion `comp->count > 0' ... status=-80";
  // daemon/transport/ucx/ucx_peer_kill_test). Copied sends (bcopy) fail once. The threshold is
  // UCP's, for every transport, so it stays where rc/dc would carry the data plane (an RDMA host
  // that doesn't name tcp in UCX_TLS).
  if (tcp_may_run && std::getenv("UCX_ZCOPY_THRESH") == nullptr &&
      (!all || !RdmaDevicesPresent())) {
    config.emplace_back("ZCOPY_THRESH", "inf");
  }
  // TCP: 2 MiB segments, send and receive (UCX's defaults 8 KiB and 64 KiB), so that a gather's
  // reply (at most kGatherBytes, 1 MiB, of the data plane's reads: ucx_gather.cc) is ONE eager
  // fragment, handed to our handler in place in the receive segment. With smaller segments UCX
  // 1.13 reassembled every multi-fragment reply into a buffer it mallocs per message (1 MiB:
  // an mmap, 256 page faults and a munmap each) and copied each fragment there before our
  // handler copied it again into the staging slot: the engine's refitd spent 0.30 s of CPU per
  // 256 MiB version over loopback tcp, 0.11 s with 2 MiB segments (the trainer's 0.06 -> 0.075).
  // Before that, 64 KiB send segments against UCX's 8 KiB took a 1 GiB version from 0.65 to
  // 0.41 s. UCX hands a setting it doesn't know itself to its transports under the unprefixed
  // name (TX_SEG_SIZE and RX_SEG_SIZE are tcp's), and warns when none takes it: only when tcp may
  // be in use, and never over the operator's tcp segment sizes (UCX refuses a send segment above
  // the receive segment). Segments come from pools on demand: an endpoint holds one while a
  // message is half-sent or half-received.
  if (tcp_may_run && std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr &&
      std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr) {
    config.emplace_back("TX_SEG_SIZE", kTcpSegment);
    config.emplace_back("RX_SEG_SIZE", kTcpSegment);
  }
  return config;
}

}  // namespace refit::transport
