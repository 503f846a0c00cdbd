#include "daemon/transport/ucx/ucx_binding.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace refit::transport {
namespace {

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (!a || !b || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

bool IsWildcard(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (a->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  }
  return false;
}

// RDMA devices as UCX names them ("mlx5_0:1"): they listen on no TCP port, so restricting UCX
// to --listen's interface keeps them.
std::vector<std::string> RdmaDevices() {
  std::vector<std::string> out;
  std::error_code ec;
  const std::filesystem::path root("/sys/class/infiniband");
  for (const auto& device : std::filesystem::directory_iterator(root, ec)) {
    std::error_code port_ec;
    for (const auto& port : std::filesystem::directory_iterator(device.path() / "ports", port_ec)) {
      out.push_back(device.path().filename().string() + ":" + port.path().filename().string());
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> InterfaceForHost(const std::string& host_in) {
  std::string host = host_in;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "*") return std::string();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &resolved); rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("--listen host ", host, " does not resolve: ", gai_strerror(rc)));
  }
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) {
    freeaddrinfo(resolved);
    return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::string found;
  bool wildcard = false;
  for (addrinfo* a = resolved; a && found.empty() && !wildcard; a = a->ai_next) {
    if (IsWildcard(a->ai_addr)) {
      wildcard = true;
      break;
    }
    for (ifaddrs* i = interfaces; i; i = i->ifa_next) {
      if (SameAddress(a->ai_addr, i->ifa_addr)) {
        found = i->ifa_name;
        break;
      }
    }
  }
  freeifaddrs(interfaces);
  freeaddrinfo(resolved);
  if (wildcard) return std::string();
  if (found.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--listen host ", host,
                     " is not an address of any interface of this host; give one "
                     "of its own addresses (`ip -br addr` lists them), on the cluster's network"));
  }
  return found;
}

absl::StatusOr<std::string> ParsePortRange(const std::string& range) {
  std::vector<std::string> parts = absl::StrSplit(range, '-');
  uint32_t low = 0, high = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &low) ||
      !absl::SimpleAtoi(parts[1], &high) || low < 1 || high > 65535 || low > high) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-ports=", range,
                     " is not a port range LOW-HIGH with 1 <= LOW <= HIGH <= 65535 "
                     "(e.g. --data-ports=7100-7199)"));
  }
  return absl::StrCat(low, "-", high);
}

absl::StatusOr<std::vector<UcxSetting>> UcxBindingConfig(const std::string& listen,
                                                         const std::string& data_ports) {
  std::vector<UcxSetting> config;
  const auto colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  auto interface = InterfaceForHost(host);
  if (!interface.ok()) return interface.status();
  if (!interface->empty()) {
    std::vector<std::string> devices = {*interface};
    for (const std::string& rdma : RdmaDevices()) devices.push_back(rdma);
    config.push_back({"NET_DEVICES", absl::StrJoin(devices, ","), "UCX_NET_DEVICES"});
  }
  if (!data_ports.empty()) {
    auto range = ParsePortRange(data_ports);
    if (!range.ok()) return range.status();
    // Set through ucp_config_modify, a tcp setting goes by its unprefixed name.
    config.push_back({"PORT_RANGE", *range, "UCX_TCP_PORT_RANGE"});
  }
  return config;
}

}  // namespace refit::transport
