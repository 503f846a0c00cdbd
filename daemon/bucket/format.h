#pragma once

// The storage bucket's on-disk format: directory and file names, and the manifest of a version
// (what it is, JSON ⇄ struct, and every check a reader makes on it). docs/bucket.md describes
// the same format for people; this file is the code both sides share.
//
//   DIR/<model dir>/v<20-digit version>.manifest.json     written last: the version exists
//   DIR/<model dir>/v<20-digit version>.p<piece>.full.zst  zstd frame of the piece's bytes
//   DIR/<model dir>/v<20-digit version>.p<piece>.delta     a daemon/delta delta (FORMAT.md)
//   DIR/<model dir>/.tmp.*                                 being written; readers skip them
//
// <model dir> is the model name percent-encoded (ModelDirName); the manifest holds the real
// name. A manifest carries the XXH3 of its own canonical JSON, so a changed byte anywhere in it
// (a tensor name, a shape) is caught, not only in the data files.
//
// Pure functions and plain structs; thread-safe; no I/O.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/types.h"

namespace refit::bucket {

inline constexpr char kFormatName[] = "refit-bucket";
inline constexpr int kFormatVersion = 1;
// Prefix of files being written (temporary name + rename); readers ignore them.
inline constexpr char kTempPrefix[] = ".tmp.";
// A reader refuses larger manifests (a few KiB per hundred tensors in practice).
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

enum class PieceKind { kFull, kDelta };
const char* PieceKindName(PieceKind kind);

// One SOURCE buffer's bytes in one version, as the manifest describes them.
struct ManifestPiece {
  std::string buffer_id;
  std::vector<TensorSlice> layout;  // buffer_offset relative to the piece's first byte
  uint64_t bytes = 0;               // the piece's full size
  uint64_t xxh3 = 0;                // XXH3-64 of the piece's full bytes in this version
  PieceKind kind = PieceKind::kFull;
  uint64_t base_version = 0;  // kDelta: the version the delta applies to (< version)
  std::string file;           // a file name in the model's directory
  uint64_t file_bytes = 0;
  uint64_t file_xxh3 = 0;  // XXH3-64 of the whole file
};

struct Manifest {
  std::string model;
  uint64_t version = 0;
  uint64_t created_unix_ms = 0;  // informational
  std::vector<ManifestPiece> pieces;

  // True when every piece is stored in full (the version needs no other version).
  bool AllFull() const;
};

// The manifest as JSON text (with its self-checksum). INVALID_ARGUMENT when a string is not
// valid UTF-8 or the manifest fails CheckManifest.
absl::StatusOr<std::string> SerializeManifest(const Manifest& manifest);

// Parses and checks manifest text (untrusted). DATA_LOSS for anything malformed, truncated or
// inconsistent (checksum, field types, file names with '/' or "..", layouts outside the piece);
// UNIMPLEMENTED for a newer format version. Never throws.
absl::StatusOr<Manifest> ParseManifest(std::string_view text);

// The checks ParseManifest makes on the parsed fields (the writer runs them too). Returns
// INVALID_ARGUMENT describing the first problem. Normalizes the layouts (plan::
// NormalizeAndValidateBuffer fills empty offsets, sizes and strides).
absl::Status CheckManifest(Manifest& manifest);

// True when both layouts hold the same slices in the same order (every field equal).
bool SameLayout(const std::vector<TensorSlice>& a, const std::vector<TensorSlice>& b);

// --- names -----------------------------------------------------------------------------------

// The directory name of `model`: bytes other than [A-Za-z0-9_.-] (and a leading '.') become
// %XX; names whose encoding is longer than 200 bytes are cut at 150 and get "~" + 16 hex digits
// of the name's XXH3. INVALID_ARGUMENT for an empty name.
absl::StatusOr<std::string> ModelDirName(std::string_view model);
// The model name for a directory name without "~" (decodes %XX); nullopt when it is not one
// ModelDirName makes (a "~" name must be read from a manifest).
std::optional<std::string> ModelNameFromDir(std::string_view dir_name);

std::string ManifestFileName(uint64_t version);
std::string DataFileName(uint64_t version, size_t piece, PieceKind kind);
// The version in a file name "v<20 digits>.<anything>"; nullopt for other names.
std::optional<uint64_t> VersionOfFileName(std::string_view name);
// True for v<20 digits>.manifest.json.
bool IsManifestFileName(std::string_view name);
// A plain file name: 1..255 bytes, no '/', no NUL, not starting with '.' (so not "." or ".."
// and never a temporary file).
bool IsSafeFileName(std::string_view name);

// 16 lower-case hex digits, and back (nullopt unless exactly 16 hex digits).
std::string Hex64(uint64_t value);
std::optional<uint64_t> ParseHex64(std::string_view text);

}  // namespace refit::bucket
