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
  // TCP: 64 KiB send segments (UCX's default 8 KiB) carry a get's reply in 8x fewer pieces; a
  // 1 GiB version over loopback tcp took 0.41 s against 0.65 s (same hour; ucx_perftest of
  // 4 MiB gets: 1.96 against 1.03 GB/s). Receive segments are 64 KiB already. UCX hands a
  // setting it doesn't know itself to its transports under the unprefixed name (TX_SEG_SIZE
  // is tcp's), and warns when none takes it: only when tcp may be in use, and never over the
  // operator's tcp segment sizes (UCX refuses a send segment above the receive segment).
  if (tcp_may_run && std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr &&
      std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr) {
    config.emplace_back("TX_SEG_SIZE", "64k");
  }
  return config;
}

}  // namespace refit::transport
