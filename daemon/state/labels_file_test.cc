#include "daemon/state/labels_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "catch2/catch.hpp"
#include "daemon/rl/labels.h"

namespace refit::state {
namespace {

std::string FreshDir() {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("refit-labels-test-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST_CASE("labels set through VersionLabels come back after a restart") {
  const std::string dir = FreshDir();
  {
    auto file = LabelsFile::Open(dir);
    REQUIRE(file.ok());
    rl::VersionLabels labels;
    labels.set_store(file->get());
    labels.Set("policy", 3, {{"step", "3"}, {"run", "r1"}});
    CHECK(labels.SetIfAbsent("policy", 4, {{"step", "4"}}));
    labels.Set("odd/name with spaces", 1, {{"lora.rank", "16"}});
    labels.Set("gone", 1, {{"a", "b"}});
    labels.Erase("gone", 1);  // its file goes
  }
  auto file = LabelsFile::Open(dir);
  REQUIRE(file.ok());
  const LabelsFile::Loaded loaded = (*file)->Load();
  CHECK(loaded.skipped.empty());
  REQUIRE(loaded.models.size() == 2);
  CHECK(loaded.models.at("policy").at(3).at("run") == "r1");
  CHECK(loaded.models.at("policy").at(4).at("step") == "4");
  CHECK(loaded.models.at("odd/name with spaces").at(1).at("lora.rank") == "16");
  CHECK(!std::filesystem::exists((*file)->PathOf("gone")));

  rl::VersionLabels restored;
  for (const auto& [model, versions] : loaded.models) restored.Restore(model, versions);
  CHECK(restored.Get("policy", 3).at("step") == "3");
  CHECK(restored.Recent("policy").size() == 2);
  CHECK(restored.RestoredModels() == std::vector<std::string>{"odd/name with spaces", "policy"});
  restored.Forget("policy");
  CHECK(restored.RestoredModels() == std::vector<std::string>{"odd/name with spaces"});
  std::filesystem::remove_all(dir);
}

TEST_CASE("only the newest versions are kept, in the file too") {
  const std::string dir = FreshDir();
  auto file = LabelsFile::Open(dir);
  REQUIRE(file.ok());
  rl::VersionLabels labels;
  labels.set_store(file->get());
  for (uint64_t v = 1; v <= rl::VersionLabels::kKeepVersions + 5; ++v) {
    labels.Set("m", v, {{"step", std::to_string(v)}});
  }
  const auto loaded = (*file)->Load();
  REQUIRE(loaded.models.at("m").size() == rl::VersionLabels::kKeepVersions);
  CHECK(loaded.models.at("m").begin()->first == 6);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a file that can't be read back is left out, naming it") {
  const std::string dir = FreshDir();
  auto file = LabelsFile::Open(dir);
  REQUIRE(file.ok());
  rl::VersionLabels labels;
  labels.set_store(file->get());
  labels.Set("good", 1, {{"step", "1"}});
  std::ofstream((std::filesystem::path(dir) / "labels" / "broken.json").string()) << "{not json";
  std::ofstream((std::filesystem::path(dir) / "labels" / "big.json").string())
      << R"({"format": "refit-labels", "format_version": 1, "model": "big",
            "versions": {"1": {"k": ")"
      << std::string(2000, 'x') << R"("}}})";
  const auto loaded = (*file)->Load();
  CHECK(loaded.models.size() == 1);
  CHECK(loaded.models.count("good") == 1);
  REQUIRE(loaded.skipped.size() == 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::state
