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

TEST_CASE("a named run may restart its numbers; runs left are refused, across restarts",
          "[state]") {
  const std::string dir = TempDir();
  {
    auto ledger = VersionLedger::Open(dir);
    REQUIRE(ledger.ok());
    REQUIRE((*ledger)->Record("m", 600, "run-a").ok());
    CHECK((*ledger)->Run("m") == "run-a");
    // Empty: the current run, with its reused-number refusal.
    CHECK((*ledger)->Check("m", 500).code() == absl::StatusCode::kFailedPrecondition);
    CHECK((*ledger)->Check("m", 500, "run-a").code() == absl::StatusCode::kFailedPrecondition);
    CHECK((*ledger)->Check("m", 500, "run-b").ok());
    REQUIRE((*ledger)->Record("m", 500, "run-b").ok());
    CHECK((*ledger)->Newest("m") == 500);
  }
  auto reopened = VersionLedger::Open(dir);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->Run("m") == "run-b");
  CHECK((*reopened)->PastRuns("m") == std::vector<std::string>{"run-a"});
  CHECK((*reopened)->Newest("m") == 500);
  CHECK((*reopened)->Check("m", 500).code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*reopened)->Check("m", 501).ok());
  const absl::Status left = (*reopened)->Check("m", 900, "run-a");
  CHECK(left.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(left.message()).find("replaced by run run-b") != std::string::npos);
  // A state file from before runs (no run keys) still opens.
  const std::string old_dir = TempDir();
  WriteFile(
      old_dir + "/state.json",
      R"({"format": "refit-state", "format_version": 1, "models": {"x": {"newest_published": 3}}})");
  auto old = VersionLedger::Open(old_dir);
  REQUIRE(old.ok());
  CHECK((*old)->Run("x").empty());
  CHECK((*old)->Check("x", 3, "run-1").ok());
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
