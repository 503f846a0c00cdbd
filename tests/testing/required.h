#pragma once

// The steps nearly every integration test takes, each failing the running Catch2 test when it
// does not succeed: shared memory made, a refitd started, a client connected.
//
// Not thread-safe: call from the test's own thread (Catch2's REQUIRE).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit::testing {

// A fresh shared memory object of `size` bytes, named from `tag` (UniqueShmName).
client::SharedMemory MakeShm(const std::string& tag, uint64_t size);

// DaemonProcess::Start(args, "", env, wrapper).
std::unique_ptr<DaemonProcess> StartDaemon(const std::vector<std::string>& args,
                                           const std::vector<std::string>& env = {},
                                           const std::vector<std::string>& wrapper = {});

// A client of `daemon`.
std::unique_ptr<client::Client> ClientOf(const DaemonProcess& daemon);

}  // namespace refit::testing
