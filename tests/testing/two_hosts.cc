#include "tests/testing/two_hosts.h"

#include <unistd.h>

#include <cstdlib>

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

}  // namespace refit::testing
