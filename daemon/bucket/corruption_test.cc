// A corrupt or partial bucket is rejected with the right code and one log line + metric, and
// the importer stays on the version it holds: truncated and flipped delta, full and manifest
// files, missing files, forged file names, missing bases, a wrong held base, and random byte
// flips anywhere (either rejected or bit-exact, never wrong bytes).

#include <xxhash.h>

#include <functional>
#include <random>
#include <string>

#include "catch2/catch.hpp"
#include "daemon/bucket/bucket_testing.h"
#include "daemon/bucket/exporter.h"
#include "daemon/bucket/importer.h"
#include "daemon/metrics/metrics.h"
#include "nlohmann/json.hpp"

namespace refit::bucket {
namespace {

using testing::TempDir;

// Versions 1..3 of a random model exported with `full_every`, and an importer holding version 2.
struct Fixture {
  explicit Fixture(uint32_t full_every) : model(testing::RandomModel("org/m", 3, 99)) {
    ExporterOptions options;
    options.full_every = full_every;
    options.retain = 10;
    options.fsync = false;
    Exporter exporter(dir.path(), options);
    testing::ExportVersions(exporter, model, 1, 3);
    ImporterOptions importer_options;
    importer_options.metrics = &metrics;
    importer = std::make_unique<Importer>(dir.path(), importer_options);
    auto v1 = importer->Materialize(model.name, 1, nullptr, alloc);
    REQUIRE(v1.ok());
    auto v2 = importer->Materialize(model.name, 2, &*v1, alloc);
    REQUIRE(v2.ok());
    held1 = std::move(*v1);
    held2 = std::move(*v2);
  }

  std::string File(uint64_t version, size_t piece) const {
    auto manifest = importer->ReadManifest(model.name, version);
    REQUIRE(manifest.ok());
    return model_dir() + "/" + manifest->pieces[piece].file;
  }
  std::string Manifest(uint64_t version) const {
    return model_dir() + "/" + ManifestFileName(version);
  }
  std::string model_dir() const { return dir.path() + "/" + *ModelDirName(model.name); }

  // Version 3 is rejected with `code`, twice in a row counted and logged once; Next() from
  // version 2 stays there, and version 2 still materializes from version 1.
  void ExpectRejected(absl::StatusCode code) {
    const double before = metrics.Get(kBucketRejected);
    auto v3 = importer->Materialize(model.name, 3, &held2, alloc);
    INFO(v3.status().ToString());
    CHECK(v3.status().code() == code);
    CHECK(importer->Materialize(model.name, 3, &held2, alloc).status().code() == code);
    CHECK(metrics.Get(kBucketRejected) == before + 1);
    auto next = importer->Next(model.name, &held2, alloc);
    if (next.ok()) {
      CHECK_FALSE(next->has_value());
    } else {
      CHECK(next.status().code() == code);
    }
    auto again = importer->Next(model.name, &held2, alloc);
    if (code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kUnimplemented ||
        code == absl::StatusCode::kFailedPrecondition) {  // remembered: not read again
      REQUIRE(again.ok());
      CHECK_FALSE(again->has_value());
    }
    auto v2 = importer->Materialize(model.name, 2, &held1, alloc);
    REQUIRE(v2.ok());
    CHECK(testing::SameBytes(*v2, model, 2));
    CHECK(testing::SameBytes(held2, model, 2));
  }

  TempDir dir;
  testing::TestModel model;
  Metrics metrics;
  std::unique_ptr<Importer> importer;
  Allocator alloc = testing::HostAllocator();
  ImportedVersion held1, held2;
};

std::string Sealed(nlohmann::json json) {
  json.erase("checksum");
  const std::string canonical = json.dump();
  json["checksum"] = Hex64(XXH3_64bits(canonical.data(), canonical.size()));
  return json.dump(1);
}

void Rewrite(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  auto text = testing::ReadFile(path);
  REQUIRE(text.has_value());
  nlohmann::json json = nlohmann::json::parse(text->begin(), text->end());
  edit(json);
  const std::string sealed = Sealed(json);
  testing::WriteFile(path, testing::Bytes(sealed.begin(), sealed.end()));
}

TEST_CASE("a truncated delta file is DATA_LOSS", "[bucket][corrupt]") {
  Fixture f(8);
  const std::string file = f.File(3, 0);
  REQUIRE(file.substr(file.size() - 6) == ".delta");
  testing::Truncate(file, 100);
  f.ExpectRejected(absl::StatusCode::kDataLoss);
}

TEST_CASE("a flipped byte in a delta file is DATA_LOSS", "[bucket][corrupt]") {
  for (const uint64_t at : {uint64_t{5}, uint64_t{100}, uint64_t{0}}) {
    Fixture f(8);
    const std::string file = f.File(3, 2);
    const uint64_t size = testing::ReadFile(file)->size();
    testing::FlipByte(file, at == 0 ? size - 1 : at);  // header, index, last payload byte
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("a flipped byte or truncation in a full file is DATA_LOSS", "[bucket][corrupt]") {
  for (const int edit : {0, 1, 2, 3}) {
    Fixture f(1);
    const std::string file = f.File(3, 0);
    REQUIRE(file.substr(file.size() - 9) == ".full.zst");
    const uint64_t size = testing::ReadFile(file)->size();
    if (edit == 0) testing::FlipByte(file, 2);          // frame magic / header
    if (edit == 1) testing::FlipByte(file, size / 2);   // inside a block
    if (edit == 2) testing::FlipByte(file, size - 1);   // the last byte
    if (edit == 3) testing::Truncate(file, size - 10);  // partial copy
    INFO("edit " << edit);
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("a truncated or edited manifest is DATA_LOSS", "[bucket][corrupt]") {
  {
    Fixture f(8);
    testing::Truncate(f.Manifest(3), testing::ReadFile(f.Manifest(3))->size() / 2);
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
  {
    Fixture f(8);
    testing::Truncate(f.Manifest(3), 0);
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
  {
    Fixture f(8);
    auto text = *testing::ReadFile(f.Manifest(3));
    std::string manifest(text.begin(), text.end());
    const size_t at = manifest.find("\"w.q\"");
    REQUIRE(at != std::string::npos);
    testing::FlipByte(f.Manifest(3), at + 2, 0x01);  // "w.q" -> "w/q": valid JSON, wrong name
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("a missing data file is NOT_FOUND", "[bucket][corrupt]") {
  Fixture f(8);
  REQUIRE(std::remove(f.File(3, 1).c_str()) == 0);
  f.ExpectRejected(absl::StatusCode::kNotFound);
}

TEST_CASE("a manifest naming ../x or another absolute path is DATA_LOSS", "[bucket][corrupt]") {
  for (const std::string name : {"../x", "../../etc/passwd", "/etc/passwd", "..", "sub/x"}) {
    Fixture f(8);
    // A real file where the forged name would lead, to show it is never read.
    testing::WriteFile(f.dir.path() + "/x", *testing::ReadFile(f.File(3, 0)));
    Rewrite(f.Manifest(3), [&](nlohmann::json& j) { j["pieces"][0]["file"] = name; });
    INFO(name);
    f.ExpectRejected(absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("a forged manifest: sizes, bases and checksums that don't fit", "[bucket][corrupt]") {
  using Edit = std::function<void(nlohmann::json&)>;
  const std::vector<std::pair<Edit, absl::StatusCode>> cases{
      {[](auto& j) { j["pieces"][0]["file_bytes"] = 1; }, absl::StatusCode::kDataLoss},
      {[](auto& j) { j["pieces"][0]["file_bytes"] = uint64_t{1} << 50; },
       absl::StatusCode::kDataLoss},
      {[](auto& j) { j["pieces"][0]["xxh3"] = "0000000000000000"; }, absl::StatusCode::kDataLoss},
      {[](auto& j) { j["pieces"][0]["file_xxh3"] = "0000000000000000"; },
       absl::StatusCode::kDataLoss},
      {[](auto& j) { j["pieces"][0]["buffer_id"] = "other"; }, absl::StatusCode::kDataLoss},
      {[](auto& j) { j["pieces"][1]["file"] = j["pieces"][2]["file"]; },
       absl::StatusCode::kDataLoss},
      {[](auto& j) { j["model"] = "another"; }, absl::StatusCode::kDataLoss},
      {[](auto& j) { j["version"] = 4; }, absl::StatusCode::kDataLoss},
      // Huge pieces are refused before any memory is allocated.
      {[](auto& j) {
         j["pieces"][0]["bytes"] = uint64_t{1} << 59;
         j["pieces"][0]["layout"][1]["buffer_offset"] = (uint64_t{1} << 59) - 65536;
       },
       absl::StatusCode::kResourceExhausted},
      {[](auto& j) { j["format_version"] = 2; }, absl::StatusCode::kUnimplemented},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO("case " << i);
    Fixture f(8);
    Rewrite(f.Manifest(3), cases[i].first);
    f.ExpectRejected(cases[i].second);
  }
}

TEST_CASE("a delta whose base is gone is FAILED_PRECONDITION", "[bucket][corrupt]") {
  Fixture f(8);
  // Version 3 applies to version 2; the importer holds only version 1 and 2's manifest is gone.
  REQUIRE(std::remove(f.Manifest(2).c_str()) == 0);
  auto v3 = f.importer->Materialize(f.model.name, 3, &f.held1, f.alloc);
  INFO(v3.status().ToString());
  CHECK(v3.status().code() == absl::StatusCode::kFailedPrecondition);
  // Holding version 2 itself is enough.
  auto from2 = f.importer->Materialize(f.model.name, 3, &f.held2, f.alloc);
  REQUIRE(from2.ok());
  CHECK(testing::SameBytes(*from2, f.model, 3));
}

TEST_CASE("a held base that isn't what it claims is FAILED_PRECONDITION", "[bucket][corrupt]") {
  Fixture f(8);
  f.held2.pieces[0].region->data()[12345] ^= 1;
  auto v3 = f.importer->Materialize(f.model.name, 3, &f.held2, f.alloc);
  INFO(v3.status().ToString());
  CHECK(v3.status().code() == absl::StatusCode::kFailedPrecondition);
  f.held2.pieces[0].region->data()[12345] ^= 1;
  CHECK(f.importer->Materialize(f.model.name, 3, &f.held2, f.alloc).ok());
}

TEST_CASE("Next() skips a corrupt newest version for an older good one", "[bucket][corrupt]") {
  Fixture f(8);
  testing::FlipByte(f.File(3, 1), 50);
  auto next = f.importer->Next(f.model.name, &f.held1, f.alloc);
  REQUIRE(next.ok());
  REQUIRE(next->has_value());
  CHECK(testing::SameBytes(**next, f.model, 2));
  CHECK(f.metrics.Get(kBucketRejected) == 1);
}

TEST_CASE("random byte flips anywhere: rejected or bit-exact, never wrong bytes",
          "[bucket][corrupt]") {
  for (const uint32_t full_every : {1u, 8u}) {
    Fixture f(full_every);
    auto manifest = f.importer->ReadManifest(f.model.name, 3);
    REQUIRE(manifest.ok());
    std::vector<std::string> files{f.Manifest(3)};
    for (const auto& piece : manifest->pieces) files.push_back(f.model_dir() + "/" + piece.file);
    std::mt19937_64 rng(7);
    int rejected = 0, accepted = 0;
    for (int trial = 0; trial < 60; ++trial) {
      const std::string& file = files[rng() % files.size()];
      const testing::Bytes original = *testing::ReadFile(file);
      const uint64_t at = rng() % original.size();
      testing::FlipByte(file, at, static_cast<uint8_t>(1 + rng() % 255));
      auto v3 = f.importer->Materialize(f.model.name, 3, &f.held2, f.alloc);
      if (v3.ok()) {
        ++accepted;  // e.g. whitespace in the manifest turned into other whitespace
        CHECK(testing::SameBytes(*v3, f.model, 3));
      } else {
        ++rejected;
        INFO(file << " byte " << at << ": " << v3.status().ToString());
        CHECK((v3.status().code() == absl::StatusCode::kDataLoss ||
               v3.status().code() == absl::StatusCode::kFailedPrecondition ||
               v3.status().code() == absl::StatusCode::kUnimplemented));
      }
      testing::WriteFile(file, original);
    }
    CHECK(rejected > 40);
    INFO("accepted " << accepted);
  }
}

}  // namespace
}  // namespace refit::bucket
