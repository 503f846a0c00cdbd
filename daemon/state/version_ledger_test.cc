#include "daemon/state/version_ledger.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "catch2/catch.hpp"

namespace refit::state {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/ledger-XXXXXX";
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST_CASE("the newest published version outlives the process", "[state]") {
  const std::string dir = TempDir();
  {
    auto ledger = VersionLedger::Open(dir);
    REQUIRE(ledger.ok());
    CHECK((*ledger)->Check("llama", 1).ok());
    REQUIRE((*ledger)->Record("llama", 8).ok());
    CHECK((*ledger)->Check("llama", 8).ok());  // another source buffer of the same version
    CHECK((*ledger)->Check("llama", 7).code() == absl::StatusCode::kFailedPrecondition);
  }
  auto reopened = VersionLedger::Open(dir);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->Newest("llama") == 8);
  const absl::Status reused = (*reopened)->Check("llama", 8);  // an earlier process's number
  CHECK(reused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(reused.message()).find("newest published for it on this node is 8") !=
        std::string::npos);
  CHECK(std::string(reused.message()).find("refitctl drop llama") != std::string::npos);
  CHECK((*reopened)->Check("llama", 9).ok());
  CHECK((*reopened)->Check("other", 1).ok());
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);
}

TEST_CASE("Forget lets a new run start at 1, across restarts too", "[state]") {
  const std::string dir = TempDir();
  auto ledger = VersionLedger::Open(dir);
  REQUIRE(ledger.ok());
  REQUIRE((*ledger)->Record("m", 5).ok());
  auto forgotten = (*ledger)->Forget("m");
  REQUIRE(forgotten.ok());
  CHECK(*forgotten == 5);
  auto again = (*ledger)->Forget("m");
  REQUIRE(again.ok());
  CHECK(*again == 0);
  auto reopened = VersionLedger::Open(dir);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->Check("m", 1).ok());
}

TEST_CASE("a damaged state file is refused, naming the file, and left alone", "[state]") {
  const std::string dir = TempDir();
  const std::string path = dir + "/state.json";
  for (const std::string& text :
       {std::string("{not json"), std::string("[]"), std::string("{\"format\": \"other\"}"),
        std::string("{\"format\": \"refit-state\", \"format_version\": 2, \"models\": {}}"),
        std::string("{\"format\": \"refit-state\", \"format_version\": 1, \"models\": "
                    "{\"m\": {\"newest_published\": \"8\"}}}"),
        std::string("{\"format\": \"refit-state\", \"format_version\": 1, \"models\": "
                    "{\"m\": {\"newest_published\": -1}}}")}) {
    WriteFile(path, text);
    auto ledger = VersionLedger::Open(dir);
    INFO(text);
    REQUIRE_FALSE(ledger.ok());
    CHECK(ledger.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(ledger.status().message()).find(path) != std::string::npos);
    CHECK(std::string(ledger.status().message()).find("move it away") != std::string::npos);
    std::ifstream in(path);
    std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(kept == text);
  }
}

TEST_CASE("a state dir that can't be written is refused at Open, naming it", "[state]") {
  // /proc: an existing directory nobody, root included, can create a file in.
  auto ledger = VersionLedger::Open("/proc");
  REQUIRE_FALSE(ledger.ok());
  CHECK(ledger.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(ledger.status().message()).find("--state-dir=/proc: cannot write there") !=
        std::string::npos);
  // A writable one leaves no probe file behind.
  const std::string dir = TempDir();
  REQUIRE(VersionLedger::Open(dir).ok());
  CHECK(std::filesystem::is_empty(dir));
}

TEST_CASE("without a directory the ledger remembers in memory only", "[state]") {
  auto ledger = VersionLedger::Open("");
  REQUIRE(ledger.ok());
  REQUIRE((*ledger)->Record("m", 3).ok());
  CHECK((*ledger)->Check("m", 2).code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*ledger)->path().empty());
}

}  // namespace
}  // namespace refit::state
