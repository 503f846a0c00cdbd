#include "daemon/config/config.h"

#include "catch2/catch.hpp"

namespace refit {
namespace {

TEST_CASE("a config file sets every key", "[config]") {
  DaemonOptions options;
  auto status = ParseConfig(R"(
socket = "/run/refit/x.sock"
listen = "0.0.0.0:7070"
peers = ["a:7070", "b:7070"]
node = "gpu-7"
retain = 3
log_level = "debug"
metrics_listen = "0.0.0.0:9464"
health_listen = "0.0.0.0:7071"
max_slot_memory = 1073741824
max_gpu_slot_memory = 2147483648
delta_base = "policy=destination"
max_peer_connections = 24
)",
                            "test.toml", &options);
  REQUIRE(status.ok());
  CHECK(options.socket_path == "/run/refit/x.sock");
  CHECK(options.listen == "0.0.0.0:7070");
  CHECK(options.peers == std::vector<std::string>{"a:7070", "b:7070"});
  CHECK(options.node == "gpu-7");
  CHECK(options.retain == 3);
  CHECK(options.log_level == "debug");
  CHECK(options.metrics_listen == "0.0.0.0:9464");
  CHECK(options.health_listen == "0.0.0.0:7071");
  CHECK(options.max_slot_memory == uint64_t{1} << 30);
  CHECK(options.max_gpu_slot_memory == uint64_t{2} << 30);
  CHECK(options.delta_base == "policy=destination");  // its grammar is checked at start
  CHECK(options.max_peer_connections == 24);
}

TEST_CASE("peers may be one comma-separated string (a headless Service name)", "[config]") {
  DaemonOptions options;
  REQUIRE(ParseConfig("peers = \"refit-peers:7070\"\n", "t", &options).ok());
  CHECK(options.peers == std::vector<std::string>{"refit-peers:7070"});
}

TEST_CASE("unknown keys and bad values are rejected naming the key, changing nothing", "[config]") {
  DaemonOptions options;
  options.retain = 5;
  auto check = [&](const std::string& text, const std::string& needle) {
    auto status = ParseConfig(text, "bad.toml", &options);
    INFO(status.ToString());
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(status.message()).find(needle) != std::string::npos);
    CHECK(options.retain == 5);
  };
  check("retain = 0\n", "'retain'");
  check("retain = \"two\"\n", "'retain'");
  check("retian = 2\n", "'retian' is unknown");
  check("log_level = \"loud\"\n", "'log_level'");
  check("peers = [1, 2]\n", "'peers'");
  check("retain = 2\nsocket = 7\n", "'socket'");
  check("retain = = 2\n", "not valid TOML");
  check("max_gpu_slot_memory = -1\n", "'max_gpu_slot_memory'");
  check("max_gpu_slot_memory = \"40 elephants\"\n", "'max_gpu_slot_memory'");
  check("delta_base = 1\n", "'delta_base'");
  check("max_peer_connections = 0\n", "'max_peer_connections'");
}

TEST_CASE("a missing file is NOT_FOUND", "[config]") {
  DaemonOptions options;
  CHECK(LoadConfigFile("/nonexistent/refitd.toml", &options).code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace refit
