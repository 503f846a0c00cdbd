#pragma once

// Two network namespaces joined by a veth pair, as two hosts with separate network stacks:
// what tests/netns_test and tests/faults_link_test share. Needs root and iproute2; `ok` says
// whether they could be made (a test that finds it false says so loudly).

#include <memory>
#include <string>
#include <vector>

#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit::testing {

// Runs `command` through the shell, its output discarded; its exit status.
int Sh(const std::string& command);

// Namespaces `a` (192.0.2.1 on `device_a`) and `b` (192.0.2.2 on `device_b`), named from
// `prefix` (at most 9 characters: an interface name holds 15) and this process's pid; removed
// on destruction.
struct TwoHosts {
  explicit TwoHosts(const std::string& prefix);
  ~TwoHosts();
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;

  // The command prefix that runs a program in namespace `ns`.
  std::vector<std::string> In(const std::string& ns) const;

  bool ok = false;
  std::string a, b, device_a, device_b;
};

// A refitd in each namespace, plaintext peers over tcp on the veth: `source` (node host-a,
// listening on 192.0.2.1:7070) and `engine_node` (host-b, 192.0.2.2:7070, --peers the source),
// with a client to each. Fails the test if either does not start.
struct HostNodes {
  std::unique_ptr<DaemonProcess> source, engine_node;
  std::unique_ptr<client::Client> trainer, engine;
};
HostNodes StartHostNodes(const TwoHosts& hosts);

}  // namespace refit::testing
