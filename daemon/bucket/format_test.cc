// The bucket's names and manifest: escaping, file names, JSON round trip, and rejection of
// hostile manifests (every one DATA_LOSS, never a crash or an exception).

#include "daemon/bucket/format.h"

#include <xxhash.h>

#include <string>

#include "catch2/catch.hpp"
#include "daemon/bucket/bucket_testing.h"
#include "nlohmann/json.hpp"

namespace refit::bucket {
namespace {

Manifest SampleManifest() {
  Manifest manifest;
  manifest.model = "org/llama 3 \xc3\xbc";  // '/', a space, and UTF-8
  manifest.version = 7;
  manifest.created_unix_ms = 1234;
  ManifestPiece full;
  full.buffer_id = "node-a/rank0";
  full.layout = {testing::Slice("w", DType::kBF16, {4, 8}, 0),
                 testing::Slice("b", DType::kFP32, {8}, 64)};
  full.bytes = 96;
  full.xxh3 = 0x0123456789abcdefULL;
  full.file = DataFileName(7, 0, PieceKind::kFull);
  full.file_bytes = 50;
  full.file_xxh3 = ~uint64_t{0};
  ManifestPiece delta = full;
  delta.buffer_id = "node-a/rank1";
  delta.kind = PieceKind::kDelta;
  delta.base_version = 6;
  delta.file = DataFileName(7, 1, PieceKind::kDelta);
  manifest.pieces = {full, delta};
  return manifest;
}

// Serializes `json` with a correct self-checksum, as a forger who knows the format would.
std::string Sealed(nlohmann::json json) {
  json.erase("checksum");
  const std::string canonical = json.dump();
  json["checksum"] = Hex64(XXH3_64bits(canonical.data(), canonical.size()));
  return json.dump(1);
}

TEST_CASE("model names become safe, reversible directory names", "[bucket][format]") {
  CHECK(*ModelDirName("llama-3.1_8B") == "llama-3.1_8B");
  CHECK(*ModelDirName("org/llama 3") == "org%2Fllama%203");
  CHECK(*ModelDirName("..") == "%2E.");
  CHECK(*ModelDirName(".hidden") == "%2Ehidden");
  CHECK(*ModelDirName("a%b") == "a%25b");
  CHECK_FALSE(ModelDirName("").ok());
  for (const std::string name : {"llama", "org/llama 3 \xc3\xbc", "..", "../../etc", "a%b~c"}) {
    const std::string dir = *ModelDirName(name);
    CHECK(dir.find('/') == std::string::npos);
    CHECK(dir[0] != '.');
    REQUIRE(ModelNameFromDir(dir).has_value());
    CHECK(*ModelNameFromDir(dir) == name);
  }
  // Non-canonical or foreign directory names name no model.
  CHECK_FALSE(ModelNameFromDir("%41").has_value());
  CHECK_FALSE(ModelNameFromDir("a%2").has_value());
  CHECK_FALSE(ModelNameFromDir(".tmp").has_value());
  CHECK_FALSE(ModelNameFromDir("a b").has_value());
  // Long names are cut and hashed; two long names sharing a prefix still differ.
  const std::string long_a(300, 'a'), long_b = std::string(299, 'a') + "b";
  const std::string dir_a = *ModelDirName(long_a), dir_b = *ModelDirName(long_b);
  CHECK(dir_a.size() <= 200);
  CHECK(dir_a != dir_b);
  CHECK(dir_a.find('~') != std::string::npos);
  CHECK_FALSE(ModelNameFromDir(dir_a).has_value());
  const std::string long_escaped(100, '/');  // 300 bytes escaped: never cut inside a %XX
  const std::string dir_c = *ModelDirName(long_escaped);
  CHECK(dir_c.substr(0, dir_c.find('~')).size() % 3 == 0);
}

TEST_CASE("file names: versions sort, parse back, and unsafe names are refused",
          "[bucket][format]") {
  CHECK(ManifestFileName(42) == "v00000000000000000042.manifest.json");
  CHECK(DataFileName(42, 3, PieceKind::kFull) == "v00000000000000000042.p3.full.zst");
  CHECK(DataFileName(42, 0, PieceKind::kDelta) == "v00000000000000000042.p0.delta");
  CHECK(ManifestFileName(9) < ManifestFileName(10));
  CHECK(*VersionOfFileName(ManifestFileName(UINT64_MAX)) == UINT64_MAX);
  CHECK(IsManifestFileName(ManifestFileName(5)));
  CHECK_FALSE(IsManifestFileName(DataFileName(5, 0, PieceKind::kFull)));
  CHECK_FALSE(VersionOfFileName("v99999999999999999999.manifest.json").has_value());  // > 2^64
  CHECK_FALSE(VersionOfFileName("v0000000000000000004x.manifest.json").has_value());
  CHECK_FALSE(VersionOfFileName(".tmp.v00000000000000000042.manifest.json").has_value());
  for (const char* bad : {"", ".", "..", "../x", "a/b", "/etc/passwd", ".tmp.x"}) {
    CHECK_FALSE(IsSafeFileName(bad));
  }
  CHECK_FALSE(IsSafeFileName(std::string(256, 'a')));
  CHECK_FALSE(IsSafeFileName(std::string("a\0b", 3)));
  CHECK(IsSafeFileName("v00000000000000000001.p0.full.zst"));
  CHECK(Hex64(0xabcULL) == "0000000000000abc");
  CHECK(*ParseHex64("FFFFFFFFFFFFFFFF") == UINT64_MAX);
  CHECK_FALSE(ParseHex64("123").has_value());
  CHECK_FALSE(ParseHex64("000000000000000g").has_value());
}

TEST_CASE("a manifest round-trips through JSON", "[bucket][format]") {
  const Manifest manifest = SampleManifest();
  auto text = SerializeManifest(manifest);
  REQUIRE(text.ok());
  auto parsed = ParseManifest(*text);
  INFO(parsed.status().ToString());
  REQUIRE(parsed.ok());
  CHECK(parsed->model == manifest.model);
  CHECK(parsed->version == 7);
  CHECK(parsed->created_unix_ms == 1234);
  REQUIRE(parsed->pieces.size() == 2);
  CHECK_FALSE(parsed->AllFull());
  const ManifestPiece& delta = parsed->pieces[1];
  CHECK(delta.kind == PieceKind::kDelta);
  CHECK(delta.base_version == 6);
  CHECK(delta.xxh3 == 0x0123456789abcdefULL);
  CHECK(delta.file_xxh3 == ~uint64_t{0});
  REQUIRE(delta.layout.size() == 2);
  CHECK(delta.layout[1].dtype == DType::kFP32);
  CHECK(delta.layout[1].buffer_offset == 64);
  CHECK(delta.layout[0].buffer_strides == std::vector<int64_t>{8, 1});  // normalized
  // Human-readable: dtype names, hex checksums.
  CHECK(text->find("\"bf16\"") != std::string::npos);
  CHECK(text->find("\"0123456789abcdef\"") != std::string::npos);
}

TEST_CASE("the writer refuses manifests a reader would reject", "[bucket][format]") {
  Manifest bad = SampleManifest();
  bad.pieces[1].file = "../x";
  CHECK(SerializeManifest(bad).status().code() == absl::StatusCode::kInvalidArgument);
  bad = SampleManifest();
  bad.pieces[1].base_version = 7;
  CHECK(SerializeManifest(bad).status().code() == absl::StatusCode::kInvalidArgument);
  bad = SampleManifest();
  bad.pieces[0].layout[1].buffer_offset = 90;  // past the piece's 96 bytes
  CHECK(SerializeManifest(bad).status().code() == absl::StatusCode::kInvalidArgument);
  bad = SampleManifest();
  bad.model = "bad \xff utf-8";
  CHECK(SerializeManifest(bad).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("hostile manifests are DATA_LOSS, never a crash", "[bucket][format]") {
  const std::string good = *SerializeManifest(SampleManifest());
  const nlohmann::json json = nlohmann::json::parse(good);
  auto code = [](const std::string& text) { return ParseManifest(text).status().code(); };

  CHECK(code("") == absl::StatusCode::kDataLoss);
  CHECK(code(good.substr(0, good.size() / 2)) == absl::StatusCode::kDataLoss);  // truncated
  CHECK(code("[1, 2]") == absl::StatusCode::kDataLoss);
  CHECK(code(std::string(100000, '[')) == absl::StatusCode::kDataLoss);
  CHECK(code(std::string(100000, '{')) == absl::StatusCode::kDataLoss);

  // A changed byte that keeps the JSON valid is caught by the self-checksum.
  std::string renamed = good;
  renamed.replace(renamed.find("\"w\""), 3, "\"v\"");
  CHECK(code(renamed) == absl::StatusCode::kDataLoss);

  // Well-sealed forgeries: each breaks one rule.
  auto forged = [&](auto edit) {
    nlohmann::json copy = json;
    edit(copy);
    return code(Sealed(copy));
  };
  CHECK(forged([](auto&) {}) == absl::StatusCode::kOk);
  CHECK(forged([](auto& j) { j["pieces"][0]["file"] = "../x"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["file"] = "/etc/passwd"; }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["file"] = ".."; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["file"] = ManifestFileName(7); }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][1]["file"] = j["pieces"][0]["file"]; }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["bytes"] = "96"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["bytes"] = -1; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["bytes"] = 1.5; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["bytes"] = UINT64_MAX; }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["bytes"] = 0; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["xxh3"] = "12"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["kind"] = "patch"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][1].erase("base_version"); }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][1]["base_version"] = 8; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"] = nlohmann::json::array(); }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"] = "none"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["layout"][0]["dtype"] = 99; }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["layout"][0]["dtype"] = "bf17"; }) ==
        absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) {
          j["pieces"][0]["layout"][0]["global_shape"] = {0, 8};
        }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) {
          j["pieces"][0]["layout"][0]["sizes"] = {5, 8};
        }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["pieces"][0]["layout"][1]["buffer_offset"] = 32; }) ==
        absl::StatusCode::kDataLoss);  // overlaps "w"
  CHECK(forged([](auto& j) { j["version"] = 0; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["model"] = 5; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["format"] = "other"; }) == absl::StatusCode::kDataLoss);
  CHECK(forged([](auto& j) { j["format_version"] = 2; }) == absl::StatusCode::kUnimplemented);
  CHECK(code(good.substr(0, good.rfind("\"checksum\"")) + "}") == absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace refit::bucket
