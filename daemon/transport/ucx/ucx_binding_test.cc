#include "daemon/transport/ucx/ucx_binding.h"

#include "catch2/catch.hpp"

namespace refit::transport {
namespace {

TEST_CASE("--listen's host names the interface UCX may use", "[ucx_binding]") {
  auto lo = InterfaceForHost("127.0.0.1");
  REQUIRE(lo.ok());
  CHECK(*lo == "lo");
  auto wildcard = InterfaceForHost("0.0.0.0");
  REQUIRE(wildcard.ok());
  CHECK(wildcard->empty());
  auto v6 = InterfaceForHost("[::]");
  REQUIRE(v6.ok());
  CHECK(v6->empty());
  auto elsewhere = InterfaceForHost("192.0.2.254");     // TEST-NET-1: no interface here has it
  if (elsewhere.ok()) CHECK_FALSE(elsewhere->empty());  // unless this host really has it
  if (!elsewhere.ok()) {
    CHECK(elsewhere.status().code() == absl::StatusCode::kNotFound);
    CHECK(std::string(elsewhere.status().message()).find("ip -br addr") != std::string::npos);
  }
}

TEST_CASE("UcxBindingConfig: the interface, and the port range when given", "[ucx_binding]") {
  auto config = UcxBindingConfig("127.0.0.1:7070", "7100-7199");
  REQUIRE(config.ok());
  REQUIRE(config->size() == 2);
  CHECK((*config)[0].name == "NET_DEVICES");
  CHECK((*config)[0].env == "UCX_NET_DEVICES");
  CHECK((*config)[0].value.rfind("lo", 0) == 0);
  CHECK((*config)[1].name == "PORT_RANGE");
  CHECK((*config)[1].env == "UCX_TCP_PORT_RANGE");
  CHECK((*config)[1].value == "7100-7199");
  auto everywhere = UcxBindingConfig("0.0.0.0:7070", "");
  REQUIRE(everywhere.ok());
  CHECK(everywhere->empty());
}

TEST_CASE("a bad --data-ports says what a range looks like", "[ucx_binding]") {
  for (const char* bad : {"7100", "7199-7100", "0-10", "1-70000", "a-b", "1-2-3", ""}) {
    INFO(bad);
    auto range = ParsePortRange(bad);
    REQUIRE_FALSE(range.ok());
    CHECK(std::string(range.status().message()).find("e.g. --data-ports=7100-7199") !=
          std::string::npos);
  }
  CHECK(*ParsePortRange("7100-7100") == "7100-7100");
}

}  // namespace
}  // namespace refit::transport
