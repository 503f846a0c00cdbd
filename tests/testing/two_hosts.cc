#include "tests/testing/two_hosts.h"

#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "catch2/catch.hpp"

namespace refit::testing {

int Sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

TwoHosts::TwoHosts(const std::string& prefix) {
  const std::string tag = std::to_string(getpid() % 100000);
  a = prefix + "-a-" + tag;
  b = prefix + "-b-" + tag;
  device_a = prefix + "a" + tag;
  device_b = prefix + "b" + tag;
  ok = Sh("ip netns add " + a) == 0 && Sh("ip netns add " + b) == 0 &&
       Sh("ip link add " + device_a + " type veth peer name " + device_b) == 0 &&
       Sh("ip link set " + device_a + " netns " + a) == 0 &&
       Sh("ip link set " + device_b + " netns " + b) == 0 &&
       Sh("ip -n " + a + " addr add 192.0.2.1/24 dev " + device_a) == 0 &&
       Sh("ip -n " + b + " addr add 192.0.2.2/24 dev " + device_b) == 0 &&
       Sh("ip -n " + a + " link set " + device_a + " up") == 0 &&
       Sh("ip -n " + b + " link set " + device_b + " up") == 0 &&
       Sh("ip -n " + a + " link set lo up") == 0 && Sh("ip -n " + b + " link set lo up") == 0;
}

TwoHosts::~TwoHosts() {
  Sh("ip netns del " + a);
  Sh("ip netns del " + b);
}

std::vector<std::string> TwoHosts::In(const std::string& ns) const {
  return {"/usr/sbin/ip", "netns", "exec", ns};
}

HostNodes StartHostNodes(const TwoHosts& hosts) {
  auto source = DaemonProcess::Start(
      {"--node=host-a", "--listen=192.0.2.1:7070", "--allow-plaintext-peers"}, "",
      {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + hosts.device_a}, hosts.In(hosts.a));
  REQUIRE(source.ok());
  auto engine_node = DaemonProcess::Start({"--node=host-b", "--listen=192.0.2.2:7070",
                                           "--peers=192.0.2.1:7070", "--allow-plaintext-peers"},
                                          "", {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + hosts.device_b},
                                          hosts.In(hosts.b));
  REQUIRE(engine_node.ok());
  auto trainer = (*source)->Connect();
  auto engine = (*engine_node)->Connect();
  REQUIRE(trainer.ok());
  REQUIRE(engine.ok());
  return HostNodes{std::move(source).value(), std::move(engine_node).value(),
                   std::move(trainer).value(), std::move(engine).value()};
}

}  // namespace refit::testing
