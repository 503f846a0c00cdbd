#pragma once

// Where UCX's data plane listens, from what the operator gave refitd: UCX's tcp transport opens
// a listening port on every network device it uses, on every interface unless told otherwise.
// refitd keeps it on the interface of --listen (UCX_NET_DEVICES) and, with --data-ports, in a
// port range (UCX_TCP_PORT_RANGE). RDMA devices (/sys/class/infiniband) stay usable: they open
// no TCP port. An operator's own UCX_NET_DEVICES / UCX_TCP_PORT_RANGE always win.
//
// Thread-safety: pure functions (they read the system's interfaces).

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace refit::transport {

// The network interface holding the address that `host` (an IP address or a name) resolves
// to, e.g. "lo" for 127.0.0.1; empty for a wildcard host (0.0.0.0, ::, "") — every interface.
// NOT_FOUND when no local interface has that address (a typo'd --listen).
absl::StatusOr<std::string> InterfaceForHost(const std::string& host);

// "LO-HI" -> ("LO-HI"), checked: 1 <= LO <= HI <= 65535. INVALID_ARGUMENT otherwise.
absl::StatusOr<std::string> ParsePortRange(const std::string& range);

// One UCX setting: `name` as ucp_config_modify takes it, and the environment variable that,
// when set, overrides it.
struct UcxSetting {
  std::string name;  // e.g. "NET_DEVICES", "PORT_RANGE" (tcp's, unprefixed)
  std::string value;
  std::string env;  // e.g. "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE"
};

// The UCX settings that bind the data plane as described above, for `listen` (HOST:PORT) and
// `data_ports` (empty: any port).
absl::StatusOr<std::vector<UcxSetting>> UcxBindingConfig(const std::string& listen,
                                                         const std::string& data_ports);

}  // namespace refit::transport
