#include "tests/testing/required.h"

#include <utility>

#include "catch2/catch.hpp"

namespace refit::testing {

client::SharedMemory MakeShm(const std::string& tag, uint64_t size) {
  auto shm = client::SharedMemory::Create(UniqueShmName(tag), size);
  REQUIRE(shm.ok());
  return std::move(shm).value();
}

std::unique_ptr<DaemonProcess> StartDaemon(const std::vector<std::string>& args,
                                           const std::vector<std::string>& env,
                                           const std::vector<std::string>& wrapper) {
  auto daemon = DaemonProcess::Start(args, "", env, wrapper);
  INFO(daemon.status().ToString());
  REQUIRE(daemon.ok());
  return std::move(daemon).value();
}

std::unique_ptr<client::Client> ClientOf(const DaemonProcess& daemon) {
  auto client = daemon.Connect();
  INFO(client.status().ToString());
  REQUIRE(client.ok());
  return std::move(client).value();
}

}  // namespace refit::testing
