#include "daemon/bucket/format.h"

#include <cstdio>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/xxh3.h"
#include "daemon/plan/plan.h"
#include "nlohmann/json.hpp"

namespace refit::bucket {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxPieces = 1 << 16;
constexpr size_t kMaxSlicesPerPiece = 1 << 20;
constexpr size_t kMaxRank = 32;
constexpr int kMaxJsonDepth = 8;  // object > pieces > piece > layout > slice > shape
constexpr size_t kVersionDigits = 20;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

// nlohmann's parser is iterative, but dump() and destruction recurse: refuse deep nesting
// before parsing. Counts brackets outside strings.
bool NestingWithin(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

// Field readers for untrusted JSON: a wrong type is an error, never an exception.
absl::StatusOr<const Json*> Field(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end()) return Bad(absl::StrCat("missing field \"", key, "\""));
  return &*it;
}

absl::StatusOr<uint64_t> U64(const Json& object, const char* key) {
  ASSIGN_OR_RETURN(const Json* value, Field(object, key));
  if (value->is_number_unsigned()) return value->get<uint64_t>();
  if (value->is_number_integer() && value->get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value->get<int64_t>());
  }
  return Bad(absl::StrCat("field \"", key, "\" is not a non-negative integer"));
}

absl::StatusOr<std::string> String(const Json& object, const char* key) {
  ASSIGN_OR_RETURN(const Json* value, Field(object, key));
  if (!value->is_string()) return Bad(absl::StrCat("field \"", key, "\" is not a string"));
  return value->get<std::string>();
}

absl::StatusOr<uint64_t> Hash(const Json& object, const char* key) {
  ASSIGN_OR_RETURN(std::string text, String(object, key));
  auto value = ParseHex64(text);
  if (!value) return Bad(absl::StrCat("field \"", key, "\" is not 16 hex digits"));
  return *value;
}

absl::StatusOr<std::vector<int64_t>> Ints(const Json& object, const char* key) {
  ASSIGN_OR_RETURN(const Json* value, Field(object, key));
  if (!value->is_array() || value->size() > kMaxRank) {
    return Bad(
        absl::StrCat("field \"", key, "\" is not an array of at most ", kMaxRank, " integers"));
  }
  std::vector<int64_t> out;
  for (const Json& item : *value) {
    if (item.is_number_integer() && !item.is_number_unsigned()) {
      out.push_back(item.get<int64_t>());
    } else if (item.is_number_unsigned() &&
               item.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
      out.push_back(static_cast<int64_t>(item.get<uint64_t>()));
    } else {
      return Bad(absl::StrCat("field \"", key, "\" holds a non-integer"));
    }
  }
  return out;
}

absl::StatusOr<DType> ParseDType(const Json& slice) {
  ASSIGN_OR_RETURN(const Json* value, Field(slice, "dtype"));
  if (value->is_number_integer()) {
    const int64_t id = value->get<int64_t>();
    if (id > 0 && id < 256 && DTypeSize(static_cast<DType>(id)) != 0) {
      return static_cast<DType>(id);
    }
  } else if (value->is_string()) {
    const std::string name = value->get<std::string>();
    for (int id = 1; id < 32; ++id) {
      const DType dtype = static_cast<DType>(id);
      if (DTypeSize(dtype) != 0 && name == DTypeName(dtype)) return dtype;
    }
  }
  return Bad("field \"dtype\" is not a known dtype");
}

Json SliceToJson(const TensorSlice& slice) {
  return Json{{"name", slice.name},
              {"dtype", DTypeName(slice.dtype)},
              {"dtype_id", static_cast<int>(slice.dtype)},
              {"global_shape", slice.global_shape},
              {"offsets", slice.offsets},
              {"sizes", slice.sizes},
              {"buffer_offset", slice.buffer_offset},
              {"buffer_strides", slice.buffer_strides}};
}

absl::StatusOr<TensorSlice> SliceFromJson(const Json& json) {
  if (!json.is_object()) return Bad("a layout entry is not an object");
  TensorSlice slice;
  ASSIGN_OR_RETURN(slice.name, String(json, "name"));
  ASSIGN_OR_RETURN(slice.dtype, ParseDType(json));
  ASSIGN_OR_RETURN(slice.global_shape, Ints(json, "global_shape"));
  ASSIGN_OR_RETURN(slice.offsets, Ints(json, "offsets"));
  ASSIGN_OR_RETURN(slice.sizes, Ints(json, "sizes"));
  ASSIGN_OR_RETURN(slice.buffer_offset, U64(json, "buffer_offset"));
  ASSIGN_OR_RETURN(slice.buffer_strides, Ints(json, "buffer_strides"));
  return slice;
}

Json PieceToJson(const ManifestPiece& piece) {
  Json layout = Json::array();
  for (const TensorSlice& slice : piece.layout) layout.push_back(SliceToJson(slice));
  Json json{{"buffer_id", piece.buffer_id},
            {"bytes", piece.bytes},
            {"xxh3", Hex64(piece.xxh3)},
            {"kind", PieceKindName(piece.kind)},
            {"file", piece.file},
            {"file_bytes", piece.file_bytes},
            {"file_xxh3", Hex64(piece.file_xxh3)},
            {"layout", std::move(layout)}};
  if (piece.kind == PieceKind::kDelta) json["base_version"] = piece.base_version;
  return json;
}

absl::StatusOr<ManifestPiece> PieceFromJson(const Json& json) {
  if (!json.is_object()) return Bad("a piece is not an object");
  ManifestPiece piece;
  ASSIGN_OR_RETURN(piece.buffer_id, String(json, "buffer_id"));
  ASSIGN_OR_RETURN(piece.bytes, U64(json, "bytes"));
  ASSIGN_OR_RETURN(piece.xxh3, Hash(json, "xxh3"));
  ASSIGN_OR_RETURN(std::string kind, String(json, "kind"));
  if (kind == "full") {
    piece.kind = PieceKind::kFull;
  } else if (kind == "delta") {
    piece.kind = PieceKind::kDelta;
    ASSIGN_OR_RETURN(piece.base_version, U64(json, "base_version"));
  } else {
    return Bad(absl::StrCat("unknown piece kind \"", kind, "\""));
  }
  ASSIGN_OR_RETURN(piece.file, String(json, "file"));
  ASSIGN_OR_RETURN(piece.file_bytes, U64(json, "file_bytes"));
  ASSIGN_OR_RETURN(piece.file_xxh3, Hash(json, "file_xxh3"));
  ASSIGN_OR_RETURN(const Json* layout, Field(json, "layout"));
  if (!layout->is_array() || layout->size() > kMaxSlicesPerPiece) {
    return Bad("field \"layout\" is not an array of slices");
  }
  for (const Json& slice : *layout) {
    ASSIGN_OR_RETURN(TensorSlice parsed, SliceFromJson(slice));
    piece.layout.push_back(std::move(parsed));
  }
  return piece;
}

Json ManifestToJson(const Manifest& manifest) {
  Json pieces = Json::array();
  for (const ManifestPiece& piece : manifest.pieces) pieces.push_back(PieceToJson(piece));
  return Json{{"format", kFormatName},
              {"format_version", kFormatVersion},
              {"model", manifest.model},
              {"version", manifest.version},
              {"created_unix_ms", manifest.created_unix_ms},
              {"pieces", std::move(pieces)}};
}

// XXH3 of the compact dump of `json` (std::map keeps keys sorted, so the dump is canonical).
// Throws on invalid UTF-8; callers catch.
uint64_t CanonicalHash(const Json& json) {
  const std::string text = json.dump();
  return XXH3_64bits(text.data(), text.size());
}

bool Unreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

const char* PieceKindName(PieceKind kind) { return kind == PieceKind::kFull ? "full" : "delta"; }

bool Manifest::AllFull() const {
  for (const ManifestPiece& piece : pieces) {
    if (piece.kind != PieceKind::kFull) return false;
  }
  return true;
}

absl::Status CheckManifest(Manifest& manifest) {
  if (manifest.model.empty()) return Bad("empty model name");
  if (manifest.version == 0) return Bad("version 0");
  if (manifest.pieces.empty() || manifest.pieces.size() > kMaxPieces) {
    return Bad(absl::StrCat(manifest.pieces.size(), " pieces (1 .. ", kMaxPieces, " allowed)"));
  }
  std::set<std::string> ids, files;
  for (size_t i = 0; i < manifest.pieces.size(); ++i) {
    ManifestPiece& piece = manifest.pieces[i];
    const std::string label = absl::StrCat("piece ", i, " (buffer ", piece.buffer_id, "): ");
    if (piece.buffer_id.empty() || !ids.insert(piece.buffer_id).second) {
      return Bad(label + "empty or repeated buffer id");
    }
    if (piece.bytes == 0 || piece.bytes > (uint64_t{1} << 60)) return Bad(label + "bad size");
    if (piece.kind == PieceKind::kDelta &&
        (piece.base_version == 0 || piece.base_version >= manifest.version)) {
      return Bad(absl::StrCat(label, "delta base version ", piece.base_version,
                              " is not older than version ", manifest.version));
    }
    if (!IsSafeFileName(piece.file)) {
      return Bad(absl::StrCat(label, "unsafe file name \"", piece.file, "\""));
    }
    if (IsManifestFileName(piece.file) || !files.insert(piece.file).second) {
      return Bad(absl::StrCat(label, "file \"", piece.file, "\" is a manifest or repeated"));
    }
    if (piece.file_bytes == 0) return Bad(label + "empty file");
    if (piece.layout.empty()) return Bad(label + "empty layout");
    const absl::Status layout = plan::NormalizeAndValidateBuffer(piece.layout, piece.bytes);
    if (!layout.ok()) return Bad(label + std::string(layout.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeManifest(const Manifest& manifest) {
  Manifest checked = manifest;
  RETURN_IF_ERROR(CheckManifest(checked));
  try {
    Json json = ManifestToJson(checked);
    const uint64_t checksum = CanonicalHash(json);
    json["checksum"] = Hex64(checksum);
    return json.dump(1) + "\n";
  } catch (const Json::exception& e) {
    return Bad(absl::StrCat("cannot write the manifest: ", e.what()));
  }
}

absl::StatusOr<Manifest> ParseManifest(std::string_view text) {
  auto data_loss = [](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("corrupt manifest: ", what));
  };
  if (text.size() > kMaxManifestBytes) return data_loss("larger than 64 MiB");
  if (!NestingWithin(text, kMaxJsonDepth)) return data_loss("nested too deeply");
  try {
    Json json = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded()) return data_loss("not valid JSON (truncated?)");
    if (!json.is_object()) return data_loss("not a JSON object");
    auto format = String(json, "format");
    if (!format.ok() || *format != kFormatName) return data_loss("not a refit-bucket manifest");
    auto format_version = U64(json, "format_version");
    if (!format_version.ok()) return data_loss(format_version.status().message());
    if (*format_version > static_cast<uint64_t>(kFormatVersion)) {
      return absl::UnimplementedError(absl::StrCat("manifest format version ", *format_version,
                                                   " is newer than ", kFormatVersion));
    }
    auto checksum = Hash(json, "checksum");
    if (!checksum.ok()) return data_loss(checksum.status().message());
    json.erase("checksum");
    if (CanonicalHash(json) != *checksum) return data_loss("checksum mismatch");

    Manifest manifest;
    absl::Status status = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(manifest.model, String(json, "model"));
      ASSIGN_OR_RETURN(manifest.version, U64(json, "version"));
      ASSIGN_OR_RETURN(manifest.created_unix_ms, U64(json, "created_unix_ms"));
      ASSIGN_OR_RETURN(const Json* pieces, Field(json, "pieces"));
      if (!pieces->is_array() || pieces->size() > kMaxPieces) {
        return Bad("field \"pieces\" is not an array of pieces");
      }
      for (const Json& piece : *pieces) {
        ASSIGN_OR_RETURN(ManifestPiece parsed, PieceFromJson(piece));
        manifest.pieces.push_back(std::move(parsed));
      }
      return CheckManifest(manifest);
    }();
    if (!status.ok()) return data_loss(status.message());
    return manifest;
  } catch (const std::exception& e) {  // e.g. invalid UTF-8 met by dump()
    return data_loss(e.what());
  }
}

bool SameLayout(const std::vector<TensorSlice>& a, const std::vector<TensorSlice>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const TensorSlice &x = a[i], &y = b[i];
    if (x.name != y.name || x.dtype != y.dtype || x.global_shape != y.global_shape ||
        x.offsets != y.offsets || x.sizes != y.sizes || x.buffer_offset != y.buffer_offset ||
        x.buffer_strides != y.buffer_strides) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::string> ModelDirName(std::string_view model) {
  if (model.empty()) return Bad("empty model name");
  std::string out;
  for (size_t i = 0; i < model.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(model[i]);
    if (Unreserved(c) && !(i == 0 && c == '.')) {
      out.push_back(static_cast<char>(c));
    } else {
      char escaped[4];
      std::snprintf(escaped, sizeof(escaped), "%%%02X", c);
      out += escaped;
    }
  }
  if (out.size() <= 200) return out;
  size_t cut = 150;
  while (cut > 0 && (out[cut - 1] == '%' || (cut > 1 && out[cut - 2] == '%'))) --cut;
  return out.substr(0, cut) + "~" + Hex64(XXH3_64bits(model.data(), model.size()));
}

std::optional<std::string> ModelNameFromDir(std::string_view dir_name) {
  if (dir_name.empty() || dir_name.size() > 200) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < dir_name.size(); ++i) {
    const char c = dir_name[i];
    if (c == '%') {
      if (i + 2 >= dir_name.size()) return std::nullopt;
      const int hi = HexValue(dir_name[i + 1]), lo = HexValue(dir_name[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (Unreserved(static_cast<unsigned char>(c)) && !(i == 0 && c == '.')) {
      out.push_back(c);
    } else {
      return std::nullopt;
    }
  }
  // Only the canonical encoding names a model (so "%41" and "A" are not the same model twice).
  auto canonical = ModelDirName(out);
  if (!canonical.ok() || *canonical != dir_name) return std::nullopt;
  return out;
}

std::string ManifestFileName(uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof(name), "v%020llu.manifest.json",
                static_cast<unsigned long long>(version));
  return name;
}

std::string DataFileName(uint64_t version, size_t piece, PieceKind kind) {
  char name[96];
  std::snprintf(name, sizeof(name), "v%020llu.p%zu.%s", static_cast<unsigned long long>(version),
                piece, kind == PieceKind::kFull ? "full.zst" : "delta");
  return name;
}

std::optional<uint64_t> VersionOfFileName(std::string_view name) {
  if (name.size() < kVersionDigits + 2 || name[0] != 'v' || name[kVersionDigits + 1] != '.') {
    return std::nullopt;
  }
  uint64_t value = 0;
  for (size_t i = 1; i <= kVersionDigits; ++i) {
    const char c = name[i];
    if (c < '0' || c > '9') return std::nullopt;
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

bool IsManifestFileName(std::string_view name) {
  auto version = VersionOfFileName(name);
  return version.has_value() && name == ManifestFileName(*version);
}

bool IsSafeFileName(std::string_view name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  for (const char c : name) {
    if (c == '/' || c == '\0') return false;
  }
  return true;
}

std::string Hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::optional<uint64_t> ParseHex64(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t value = 0;
  for (const char c : text) {
    const int digit = HexValue(c);
    if (digit < 0) return std::nullopt;
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace refit::bucket
