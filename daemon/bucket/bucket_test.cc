// Export on one side, import on the other, bit-exact: real bf16 versions (shared data) and
// random multi-dtype models, every full_every, following version by version and jumping;
// retention (which files remain), restarts, odd model names, layout changes.

#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/bucket/bucket_testing.h"
#include "daemon/bucket/exporter.h"
#include "daemon/bucket/importer.h"
#include "daemon/metrics/metrics.h"

namespace refit::bucket {
namespace {

using testing::TempDir;

ExporterOptions Options(uint32_t full_every, uint32_t retain = 100) {
  ExporterOptions options;
  options.full_every = full_every;
  options.retain = retain;
  options.fsync = false;  // tests: the same code paths, without waiting for the disk
  return options;
}

// The kinds of every version's pieces, e.g. "F D D F" (all pieces alike) for versions 1..n.
std::string Kinds(Importer& importer, const std::string& model, size_t versions) {
  std::string out;
  for (size_t v = 1; v <= versions; ++v) {
    auto manifest = importer.ReadManifest(model, v);
    REQUIRE(manifest.ok());
    out += (v > 1 ? " " : "") + std::string(manifest->AllFull() ? "F" : "D");
  }
  return out;
}

// Follows the bucket version by version (base = the previous one) and jumps straight to each
// version from nothing; every result must be bit-exact.
void CheckImports(const testing::TestModel& model, const std::string& dir) {
  Importer importer(dir);
  const Allocator alloc = testing::HostAllocator();
  std::optional<ImportedVersion> current;
  for (size_t v = 1; v <= model.num_versions(); ++v) {
    auto next = importer.Materialize(model.name, v, current ? &*current : nullptr, alloc);
    INFO("follow version " << v << ": " << next.status().ToString());
    REQUIRE(next.ok());
    CHECK(testing::SameBytes(*next, model, v));
    current = std::move(*next);
  }
  for (size_t v = 1; v <= model.num_versions(); ++v) {
    auto cold = importer.Materialize(model.name, v, nullptr, alloc);
    INFO("cold version " << v << ": " << cold.status().ToString());
    REQUIRE(cold.ok());
    CHECK(testing::SameBytes(*cold, model, v));
  }
}

TEST_CASE("real bf16 versions: export then import, bit-exact, full_every 1, 2, 3",
          "[bucket][real]") {
  for (const std::string folder : {"tiny-llama-lr1e-6", "tiny-llama-lr1e-5"}) {
    auto model = testing::RealModel(folder);
    if (!model) return;
    for (const uint32_t k : {1u, 2u, 3u}) {
      INFO(folder << " full_every " << k);
      TempDir dir;
      Metrics metrics;
      ExporterOptions options = Options(k);
      options.metrics = &metrics;
      Exporter exporter(dir.path(), options);
      testing::ExportVersions(exporter, *model, 1, 4);
      Importer importer(dir.path());
      const char* expected = k == 1 ? "F F F F" : k == 2 ? "F D F D" : "F D D F";
      CHECK(Kinds(importer, model->name, 4) == expected);
      CHECK(metrics.Get(kBucketVersionsExported) == 4);
      CheckImports(*model, dir.path());
      if (k == 3) {
        // lr 1e-6 deltas are tiny next to the compressed full bytes.
        auto v1 = importer.ReadManifest(model->name, 1);
        auto v2 = importer.ReadManifest(model->name, 2);
        uint64_t full = 0, delta = 0;
        for (const auto& piece : v1->pieces) full += piece.file_bytes;
        for (const auto& piece : v2->pieces) delta += piece.file_bytes;
        INFO("full " << full << " delta " << delta);
        CHECK(delta * (folder == "tiny-llama-lr1e-6" ? 50 : 5) < full);
      }
    }
  }
}

TEST_CASE("random models: several versions, every full_every, follow and jump", "[bucket]") {
  const auto model = testing::RandomModel("org/policy v2", 7, 11);
  for (const uint32_t k : {1u, 2u, 3u}) {
    INFO("full_every " << k);
    TempDir dir;
    Exporter exporter(dir.path(), Options(k));
    testing::ExportVersions(exporter, model, 1, 7);
    Importer importer(dir.path());
    const char* expected = k == 1 ? "F F F F F F F" : k == 2 ? "F D F D F D F" : "F D D F D D F";
    CHECK(Kinds(importer, model.name, 7) == expected);
    CheckImports(model, dir.path());
    auto models = importer.ListModels();
    REQUIRE(models.ok());
    CHECK(*models == std::vector<std::string>{"org/policy v2"});
    CHECK(*importer.ListVersions(model.name) == std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7});
  }
}

TEST_CASE("a delta against the held version reads only the delta", "[bucket]") {
  const auto model = testing::RandomModel("m", 4, 12);
  TempDir dir;
  Exporter exporter(dir.path(), Options(8));
  testing::ExportVersions(exporter, model, 1, 4);
  Importer importer(dir.path());
  const Allocator alloc = testing::HostAllocator();
  auto v1 = importer.Materialize("m", 1, nullptr, alloc);
  REQUIRE(v1.ok());
  auto v3 = importer.Materialize("m", 3, &*v1, alloc);  // walks 3 -> 2 -> held 1
  REQUIRE(v3.ok());
  CHECK(testing::SameBytes(*v3, model, 3));
  auto v2 = importer.ReadManifest("m", 2);
  auto m3 = importer.ReadManifest("m", 3);
  uint64_t deltas = 0;
  for (const auto& piece : v2->pieces) deltas += piece.file_bytes;
  for (const auto& piece : m3->pieces) deltas += piece.file_bytes;
  CHECK(v3->bytes_read == deltas);
  // The caller's version is only read.
  CHECK(testing::SameBytes(*v1, model, 1));
  // Next() from v1 goes straight to the newest.
  auto next = importer.Next("m", &*v1, alloc);
  REQUIRE(next.ok());
  REQUIRE(next->has_value());
  CHECK(testing::SameBytes(**next, model, 4));
  auto none = importer.Next("m", &**next, alloc);
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
}

TEST_CASE("pieces without a usable delta, and layout changes, are stored in full", "[bucket]") {
  auto model = testing::RandomModel("m", 5, 13);
  TempDir dir;
  Exporter exporter(dir.path(), Options(100));
  testing::ExportVersions(exporter, model, 1, 2);
  // Version 3: piece 1 without a delta, piece 2 with a delta against the wrong base.
  auto deltas = testing::EncodeDeltas(model, 3);
  auto pieces = testing::Pieces(model, 3, deltas);
  pieces[1].delta = nullptr;
  pieces[2].delta_base = 1;
  REQUIRE(exporter.Write("m", 3, pieces).ok());
  Importer importer(dir.path());
  auto m3 = importer.ReadManifest("m", 3);
  REQUIRE(m3.ok());
  CHECK(m3->pieces[0].kind == PieceKind::kDelta);
  CHECK(m3->pieces[1].kind == PieceKind::kFull);
  CHECK(m3->pieces[2].kind == PieceKind::kFull);
  // Version 4: a delta that belongs to another piece (wrong size) falls back to full.
  deltas = testing::EncodeDeltas(model, 4);
  pieces = testing::Pieces(model, 4, deltas);
  pieces[0].delta = deltas[2].data();
  pieces[0].delta_size = deltas[2].size();
  REQUIRE(exporter.Write("m", 4, pieces).ok());
  auto m4 = importer.ReadManifest("m", 4);
  CHECK(m4->pieces[0].kind == PieceKind::kFull);
  CHECK(m4->pieces[1].kind == PieceKind::kDelta);
  // Version 5: a new layout (a slice renamed) makes everything full.
  model.buffers[0].layout[0].name = "w.q2";
  testing::ExportVersions(exporter, model, 5, 5);
  CHECK(importer.ReadManifest("m", 5)->AllFull());
  CheckImports(model, dir.path());
}

TEST_CASE("retention keeps the newest versions and the chains they need", "[bucket]") {
  const auto model = testing::RandomModel("m", 8, 14);
  TempDir dir;
  Metrics metrics;
  ExporterOptions options = Options(3, 2);
  options.metrics = &metrics;
  Exporter exporter(dir.path(), options);
  testing::ExportVersions(exporter, model, 1, 6);  // F1 D2 D3 F4 D5 D6
  const std::string model_dir = dir.path() + "/m";
  auto version_files = [&](uint64_t v, PieceKind kind) {
    std::vector<std::string> names{ManifestFileName(v)};
    for (size_t p = 0; p < 3; ++p) names.push_back(DataFileName(v, p, kind));
    return names;
  };
  auto expect = [&](std::vector<std::vector<std::string>> groups) {
    std::vector<std::string> names;
    for (const auto& group : groups) names.insert(names.end(), group.begin(), group.end());
    std::sort(names.begin(), names.end());
    CHECK(testing::Files(model_dir) == names);
  };
  // Keep 5 and 6; 6 and 5 are deltas back to full 4: 1..3 go.
  expect({version_files(4, PieceKind::kFull), version_files(5, PieceKind::kDelta),
          version_files(6, PieceKind::kDelta)});
  CHECK(metrics.Get(kBucketFilesPruned) == 12);
  testing::ExportVersions(exporter, model, 7, 7);  // F7: keep 6, 7; 6 still needs 4, 5
  expect({version_files(4, PieceKind::kFull), version_files(5, PieceKind::kDelta),
          version_files(6, PieceKind::kDelta), version_files(7, PieceKind::kFull)});
  testing::ExportVersions(exporter, model, 8, 8);  // D8: keep 7, 8
  expect({version_files(7, PieceKind::kFull), version_files(8, PieceKind::kDelta)});

  Importer importer(dir.path());
  const Allocator alloc = testing::HostAllocator();
  CHECK(*importer.ListVersions("m") == std::vector<uint64_t>{7, 8});
  auto v8 = importer.Materialize("m", 8, nullptr, alloc);
  REQUIRE(v8.ok());
  CHECK(testing::SameBytes(*v8, model, 8));
  CHECK(importer.Materialize("m", 3, nullptr, alloc).status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("retention removes stray files of failed writes and stale temporary files", "[bucket]") {
  const auto model = testing::RandomModel("m", 3, 15);
  TempDir dir;
  ExporterOptions options = Options(1, 1);
  options.stale_temp_seconds = 0;
  Exporter exporter(dir.path(), options);
  testing::ExportVersions(exporter, model, 1, 1);
  const std::string model_dir = dir.path() + "/m";
  testing::WriteFile(model_dir + "/" + DataFileName(2, 0, PieceKind::kFull), {1, 2, 3});
  testing::WriteFile(model_dir + "/.tmp.crashed", {1});
  testing::WriteFile(model_dir + "/notes.txt", {1});  // not ours: left alone
  testing::ExportVersions(exporter, model, 3, 3);
  std::vector<std::string> expected{"notes.txt", ManifestFileName(3)};
  for (size_t p = 0; p < 3; ++p) expected.push_back(DataFileName(3, p, PieceKind::kFull));
  std::sort(expected.begin(), expected.end());
  CHECK(testing::Files(model_dir) == expected);
}

TEST_CASE("an exporter continues a bucket after a restart", "[bucket]") {
  const auto model = testing::RandomModel("m", 6, 16);
  TempDir dir;
  {
    ExporterOptions options = Options(4);
    options.fsync = true;  // the production setting, once
    Exporter first(dir.path(), options);
    testing::ExportVersions(first, model, 1, 3);  // F D D
  }
  Exporter second(dir.path(), Options(4));
  auto pieces = testing::Pieces(model, 3, testing::EncodeDeltas(model, 3));
  CHECK(second.Write("m", 3, pieces).status().code() == absl::StatusCode::kFailedPrecondition);
  testing::ExportVersions(second, model, 4, 6);  // D4 continues the chain, then F5 D6
  Importer importer(dir.path());
  CHECK(Kinds(importer, "m", 6) == "F D D D F D");
  CheckImports(model, dir.path());
}

TEST_CASE("model names with '/', spaces, dots and 300 bytes round-trip", "[bucket]") {
  TempDir dir;
  Exporter exporter(dir.path(), Options(2));
  std::vector<std::string> names{"org/llama 3 \xc3\xbc", "..", std::string(300, 'x')};
  for (size_t i = 0; i < names.size(); ++i) {
    const auto model = testing::RandomModel(names[i], 2, 20 + i);
    testing::ExportVersions(exporter, model, 1, 2);
    CheckImports(model, dir.path());
  }
  Importer importer(dir.path());
  auto models = importer.ListModels();
  REQUIRE(models.ok());
  std::sort(names.begin(), names.end());
  CHECK(*models == names);
  // Nothing was written outside DIR.
  for (const std::string& entry : testing::Files(dir.path())) FAIL("stray file " << entry);
}

TEST_CASE("a 9 MiB piece streams through several blocks, with zstd threads", "[bucket]") {
  // Half random, half runs, so zstd has something to do; three versions, full every time.
  testing::TestModel model{"big",
                           {{"rank0", {testing::Slice("w", DType::kBF16, {4608, 1024}, 0)}, {}}}};
  std::mt19937_64 rng(5);
  testing::Bytes bytes(9 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = i < bytes.size() / 2 ? static_cast<uint8_t>(rng()) : static_cast<uint8_t>(i >> 12);
  }
  model.buffers[0].versions.push_back(bytes);
  for (int v = 1; v < 3; ++v) {
    model.buffers[0].versions.push_back(
        testing::Step(model.buffers[0].versions.back(), 2, 0.001, rng));
  }
  TempDir dir;
  ExporterOptions options = Options(1);
  options.zstd_workers = 2;
  Exporter exporter(dir.path(), options);
  testing::ExportVersions(exporter, model, 1, 3);
  Importer importer(dir.path());
  auto manifest = importer.ReadManifest("big", 3);
  REQUIRE(manifest.ok());
  CHECK(manifest->pieces[0].file_bytes < bytes.size() * 3 / 4);
  CheckImports(model, dir.path());
  // A flipped byte deep inside (past the first read block) is still caught.
  const std::string file = dir.path() + "/big/" + manifest->pieces[0].file;
  testing::FlipByte(file, manifest->pieces[0].file_bytes - 1000);
  CHECK(importer.Materialize("big", 3, nullptr, testing::HostAllocator()).status().code() ==
        absl::StatusCode::kDataLoss);
}

TEST_CASE("bad export calls are refused", "[bucket]") {
  const auto model = testing::RandomModel("m", 1, 17);
  TempDir dir;
  Exporter exporter(dir.path(), Options(2));
  auto pieces = testing::Pieces(model, 1, {});
  CHECK(exporter.Write("m", 0, pieces).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(exporter.Write("", 1, pieces).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(exporter.Write("m", 1, {}).status().code() == absl::StatusCode::kInvalidArgument);
  auto twice = pieces;
  twice[1].buffer_id = twice[0].buffer_id;
  CHECK(exporter.Write("m", 1, twice).status().code() == absl::StatusCode::kInvalidArgument);
  auto outside = pieces;
  outside[0].bytes = 100;  // smaller than its layout
  CHECK(exporter.Write("m", 1, outside).status().code() == absl::StatusCode::kInvalidArgument);
  Exporter bad(dir.path(), Options(0));
  CHECK(bad.Write("m", 1, pieces).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(exporter.Write("m", 1, pieces).ok());
}

}  // namespace
}  // namespace refit::bucket
