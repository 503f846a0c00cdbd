// The option table is the one declaration of refitd's options: docs/api.md's flag reference
// is generated from it (scripts/check/options-doc.sh), the sample config names every key, and the
// config file and the command line take the same values.
#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "catch2/catch.hpp"
#include "daemon/config/cli.h"
#include "daemon/config/config.h"
#include "daemon/config/option_table.h"

namespace refit::config {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST_CASE("docs/api.md holds the flag reference the table renders", "[config]") {
  const std::string api = ReadFile("docs/api.md");
  const std::string begin = "<!-- options:begin -->\n", end = "<!-- options:end -->";
  const size_t a = api.find(begin), b = api.find(end);
  REQUIRE(a != std::string::npos);
  REQUIRE(b != std::string::npos);
  INFO("docs/api.md is out of date: run scripts/check/options-doc.sh");
  CHECK(api.substr(a + begin.size(), b - a - begin.size()) == RenderMarkdown());
}

TEST_CASE("the sample config file shows every key", "[config]") {
  const std::string sample = ReadFile("deploy/refitd.toml");
  for (const OptionSpec& spec : OptionTable()) {
    INFO(spec.Key());
    const bool set = sample.find("\n" + spec.Key() + " = ") != std::string::npos;
    const bool commented = sample.find("\n# " + spec.Key() + " = ") != std::string::npos;
    CHECK((set || commented));
  }
}

TEST_CASE("an unknown key's error lists every key of the table", "[config]") {
  DaemonOptions options;
  auto status = ParseConfig("no_such_key = 1\n", "t.toml", &options);
  REQUIRE(status.code() == absl::StatusCode::kInvalidArgument);
  for (const OptionSpec& spec : OptionTable()) {
    INFO(spec.Key());
    CHECK(std::string(status.message()).find(spec.Key()) != std::string::npos);
  }
}

// Parses argv with the table's command line over default options.
absl::Status FromFlags(std::vector<std::string> args, DaemonOptions* options) {
  CLI::App app;
  CommandLine command_line(&app);
  args.insert(args.begin(), "refitd");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  command_line.ApplyGiven(options);
  return absl::OkStatus();
}

TEST_CASE("a flag and its config key take the same values to the same result", "[config]") {
  struct Case {
    std::string flag, toml;
  };
  const std::vector<Case> cases = {
      {"--max-slot-memory=64GiB", "max_slot_memory = \"64GiB\""},
      {"--max-slot-memory=1073741824", "max_slot_memory = 1073741824"},
      {"--max-gpu-slot-memory=1.5GiB", "max_gpu_slot_memory = \"1.5GiB\""},
      {"--retain=7", "retain = 7"},
      {"--delta-threshold=0.25", "delta_threshold = 0.25"},
      {"--relay=false", "relay = false"},
      {"--peers=a:1,b:2", "peers = [\"a:1\", \"b:2\"]"},
      {"--allow-uids=1000,1001", "allow_uids = [1000, 1001]"},
      {"--log-level=debug", "log_level = \"debug\""},
      {"--slot-device=3", "slot_device = 3"},
  };
  for (const Case& c : cases) {
    INFO(c.flag);
    DaemonOptions by_flag, by_file;
    REQUIRE(FromFlags({c.flag}, &by_flag).ok());
    REQUIRE(ParseConfig(c.toml + "\n", "t.toml", &by_file).ok());
    CHECK(by_flag.max_slot_memory == by_file.max_slot_memory);
    CHECK(by_flag.max_gpu_slot_memory == by_file.max_gpu_slot_memory);
    CHECK(by_flag.retain == by_file.retain);
    CHECK(by_flag.delta_threshold == by_file.delta_threshold);
    CHECK(by_flag.relay == by_file.relay);
    CHECK(by_flag.peers == by_file.peers);
    CHECK(by_flag.allow_uids == by_file.allow_uids);
    CHECK(by_flag.log_level == by_file.log_level);
    CHECK(by_flag.slot_device == by_file.slot_device);
  }
  DaemonOptions o;
  REQUIRE(FromFlags({"--max-slot-memory=64GiB"}, &o).ok());
  CHECK(o.max_slot_memory == uint64_t{64} << 30);
}

TEST_CASE("bad values are refused by flag and by key alike, naming what is expected", "[config]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--retain=0", "retain = 0"},
      {"--max-slot-memory=64 potatoes", "max_slot_memory = \"64 potatoes\""},
      {"--delta-threshold=2", "delta_threshold = 2"},
      {"--log-level=loud", "log_level = \"loud\""},
      {"--relay=maybe", "relay = \"maybe\""},
      {"--allow-uids=-1", "allow_uids = [-1]"},
      {"--slot-memory=disk", "slot_memory = \"disk\""},
  };
  for (const auto& [flag, toml] : cases) {
    INFO(flag);
    DaemonOptions options;
    const auto by_flag = FromFlags({flag}, &options);
    const auto by_file = ParseConfig(toml + "\n", "t.toml", &options);
    CHECK(by_flag.code() == absl::StatusCode::kInvalidArgument);
    CHECK(by_file.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(by_file.message()).find("must be") != std::string::npos);
    CHECK(std::string(by_flag.message()).find("must be") != std::string::npos);
  }
}

TEST_CASE("sizes", "[config]") {
  uint64_t bytes = 0;
  CHECK((ParseSize("0", &bytes) && bytes == 0));
  CHECK((ParseSize("512k", &bytes) && bytes == 512 * 1024));
  CHECK((ParseSize("5MiB", &bytes) && bytes == 5 << 20));
  CHECK((ParseSize("1.5 GiB", &bytes) && bytes == 3ull << 29));
  CHECK((ParseSize("2TB", &bytes) && bytes == 2ull << 40));
  CHECK(!ParseSize("", &bytes));
  CHECK(!ParseSize("GiB", &bytes));
  CHECK(!ParseSize("1.3B", &bytes));
  CHECK(!ParseSize("99999999999T", &bytes));
  CHECK(!ParseSize("-1", &bytes));
}

}  // namespace
}  // namespace refit::config
