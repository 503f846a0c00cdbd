#include "daemon/bucket/importer.h"

#include <sys/stat.h>

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/bucket/file_io.h"
#include "daemon/bucket/full_codec.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/xxh3.h"
#include "daemon/delta/delta.h"

namespace refit::bucket {
namespace {

// Longest delta chain a reader follows; a well-formed bucket needs full_every - 1 at most.
constexpr size_t kMaxChain = 4096;

// Reads a delta file, header first, so that a forged size can't make us allocate more than a
// delta for a piece of `piece_bytes` bytes can hold. Checks the file's size and XXH3 against
// the manifest and the delta's index against the piece.
absl::StatusOr<std::vector<uint8_t>> ReadDelta(const std::string& path,
                                               const ManifestPiece& piece) {
  ASSIGN_OR_RETURN(internal::Fd fd, internal::OpenForRead(path));
  ASSIGN_OR_RETURN(const uint64_t size, internal::FileSize(fd.get(), path));
  if (size != piece.file_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, the manifest says ",
                                            piece.file_bytes,
                                            size < piece.file_bytes ? " (truncated)" : ""));
  }
  std::vector<uint8_t> bytes(std::min<uint64_t>(size, delta::kFixedHeaderBytes));
  RETURN_IF_ERROR(internal::PreadExactly(fd.get(), bytes.data(), bytes.size(), 0, path));
  auto header_size = delta::HeaderSize(bytes.data(), bytes.size());
  if (!header_size.ok() || *header_size > size) {
    return absl::DataLossError(absl::StrCat(path, ": not a delta (bad header)"));
  }
  bytes.resize(*header_size);
  RETURN_IF_ERROR(internal::PreadExactly(fd.get(), bytes.data(), bytes.size(), 0, path));
  auto index = delta::ParseIndex(bytes.data(), bytes.size());
  if (!index.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", index.status().message()));
  }
  if (index->total_size != size || index->buffer_bytes() != piece.bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": the delta is for ", index->buffer_bytes(), " bytes in ",
                     index->total_size, " bytes; the manifest says ", piece.bytes, " in ", size));
  }
  bytes.resize(size);
  RETURN_IF_ERROR(internal::PreadExactly(fd.get(), bytes.data() + *header_size, size - *header_size,
                                         *header_size, path));
  if (XXH3_64bits(bytes.data(), bytes.size()) != piece.file_xxh3) {
    return absl::DataLossError(absl::StrCat(path, ": file checksum mismatch"));
  }
  return bytes;
}

const ImportedPiece* FindPiece(const ImportedVersion& version, const ManifestPiece& piece) {
  for (const ImportedPiece& held : version.pieces) {
    if (held.buffer_id == piece.buffer_id && held.bytes == piece.bytes && held.region &&
        held.region->kind() == MemoryKind::kHost && held.region->size() >= held.bytes) {
      return &held;
    }
  }
  return nullptr;
}

const ManifestPiece* FindPiece(const Manifest& manifest, const std::string& buffer_id) {
  for (const ManifestPiece& piece : manifest.pieces) {
    if (piece.buffer_id == buffer_id) return &piece;
  }
  return nullptr;
}

bool Sticky(const absl::Status& status) {
  return absl::IsDataLoss(status) || absl::IsUnimplemented(status) ||
         absl::IsFailedPrecondition(status);
}

}  // namespace

Importer::Importer(std::string dir, ImporterOptions options)
    : dir_(std::move(dir)), options_(options) {}

absl::StatusOr<std::string> Importer::ModelDir(const std::string& model) const {
  ASSIGN_OR_RETURN(const std::string name, ModelDirName(model));
  return absl::StrCat(dir_, "/", name);
}

absl::StatusOr<std::vector<std::string>> Importer::ListModels() const {
  ASSIGN_OR_RETURN(const auto entries, internal::ListDir(dir_));
  std::vector<std::string> models;
  for (const internal::DirEntry& entry : entries) {
    if (!entry.is_dir) continue;
    if (auto name = ModelNameFromDir(entry.name)) {
      models.push_back(*name);
      continue;
    }
    // A hashed long name: the newest readable manifest says which model it is.
    auto files = internal::ListDir(absl::StrCat(dir_, "/", entry.name));
    if (!files.ok()) continue;
    for (auto it = files->rbegin(); it != files->rend(); ++it) {
      if (!IsManifestFileName(it->name)) continue;
      auto text = internal::ReadSmallFile(absl::StrCat(dir_, "/", entry.name, "/", it->name),
                                          kMaxManifestBytes);
      auto manifest = text.ok() ? ParseManifest(*text) : absl::StatusOr<Manifest>(text.status());
      if (!manifest.ok()) continue;
      auto expected = ModelDirName(manifest->model);
      if (expected.ok() && *expected == entry.name) models.push_back(manifest->model);
      break;
    }
  }
  std::sort(models.begin(), models.end());
  return models;
}

absl::StatusOr<std::vector<uint64_t>> Importer::ListVersions(const std::string& model) const {
  ASSIGN_OR_RETURN(const std::string model_dir, ModelDir(model));
  auto entries = internal::ListDir(model_dir);
  if (absl::IsNotFound(entries.status())) return std::vector<uint64_t>{};
  if (!entries.ok()) return entries.status();
  std::vector<uint64_t> versions;
  for (const internal::DirEntry& entry : *entries) {
    if (entry.is_dir || !IsManifestFileName(entry.name)) continue;
    const uint64_t version = *VersionOfFileName(entry.name);
    if (ReadManifest(model, version).ok()) versions.push_back(version);
  }
  return versions;
}

absl::StatusOr<Manifest> Importer::ReadManifest(const std::string& model, uint64_t version) const {
  ASSIGN_OR_RETURN(const std::string model_dir, ModelDir(model));
  const std::string path = absl::StrCat(model_dir, "/", ManifestFileName(version));
  ASSIGN_OR_RETURN(const std::string text, internal::ReadSmallFile(path, kMaxManifestBytes));
  auto manifest = ParseManifest(text);
  if (!manifest.ok()) {
    return absl::Status(manifest.status().code(),
                        absl::StrCat(path, ": ", manifest.status().message()));
  }
  if (manifest->model != model || manifest->version != version) {
    return absl::DataLossError(
        absl::StrCat(path, ": names model ", manifest->model, " version ", manifest->version));
  }
  return manifest;
}

absl::StatusOr<ImportedVersion> Importer::MaterializeUnlogged(const std::string& model,
                                                              uint64_t version,
                                                              const ImportedVersion* base,
                                                              const Allocator& allocate) const {
  ASSIGN_OR_RETURN(const std::string model_dir, ModelDir(model));
  ASSIGN_OR_RETURN(const Manifest target, ReadManifest(model, version));
  uint64_t total = 0;
  for (const ManifestPiece& piece : target.pieces) {
    total += piece.bytes;  // each <= 2^60 and at most 2^16 pieces: no overflow
  }
  if (total > options_.max_version_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "version holds ", total, " bytes, more than the limit of ", options_.max_version_bytes));
  }
  if (base != nullptr && base->model != model) base = nullptr;

  std::map<uint64_t, Manifest> manifests;  // older versions met while walking back
  auto manifest_of = [&](uint64_t v) -> absl::StatusOr<const Manifest*> {
    auto it = manifests.find(v);
    if (it == manifests.end()) {
      auto read = ReadManifest(model, v);
      if (!read.ok()) return read.status();
      it = manifests.emplace(v, std::move(*read)).first;
    }
    return &it->second;
  };

  ImportedVersion out;
  out.model = model;
  out.version = version;
  for (const ManifestPiece& piece : target.pieces) {
    const std::string label = absl::StrCat("buffer ", piece.buffer_id, ": ");
    // Walk back to a full piece or to the caller's copy; chain[0] is the newest step.
    std::vector<std::pair<uint64_t, const ManifestPiece*>> chain{{version, &piece}};
    const ImportedPiece* root_held = nullptr;
    while (chain.back().second->kind == PieceKind::kDelta) {
      const ManifestPiece& step = *chain.back().second;
      const uint64_t base_version = step.base_version;
      if (base != nullptr && base->version == base_version) {
        root_held = FindPiece(*base, step);
        if (root_held != nullptr) break;
      }
      if (chain.size() >= kMaxChain) {
        return absl::DataLossError(absl::StrCat(label, "delta chain longer than ", kMaxChain));
      }
      auto older = manifest_of(base_version);
      if (absl::IsNotFound(older.status())) {
        return absl::FailedPreconditionError(
            absl::StrCat(label, "the delta of version ", chain.back().first, " applies to version ",
                         base_version, ", which is neither in the bucket any more nor held here",
                         base != nullptr ? absl::StrCat(" (held: ", base->version, ")") : ""));
      }
      if (!older.ok()) return older.status();
      const ManifestPiece* older_piece = FindPiece(**older, step.buffer_id);
      if (older_piece == nullptr || older_piece->bytes != step.bytes) {
        return absl::DataLossError(
            absl::StrCat(label, "version ", base_version, " has no piece of this buffer and size"));
      }
      chain.emplace_back(base_version, older_piece);
    }

    ASSIGN_OR_RETURN(std::shared_ptr<Region> region, allocate(piece.bytes));
    if (region == nullptr || region->kind() != MemoryKind::kHost || region->size() < piece.bytes) {
      return absl::InternalError(label + "the allocator returned no host region of that size");
    }
    uint8_t* bytes = region->data();
    if (root_held != nullptr) {
      std::memcpy(bytes, root_held->region->data(), piece.bytes);
    } else {
      const ManifestPiece& full = *chain.back().second;
      const std::string path = absl::StrCat(model_dir, "/", full.file);
      ASSIGN_OR_RETURN(internal::Fd fd, internal::OpenForRead(path));
      RETURN_IF_ERROR(internal::DecompressFromFd(fd.get(), path, full.file_bytes, full.file_xxh3,
                                                 bytes, piece.bytes));
      out.bytes_read += full.file_bytes;
      chain.pop_back();
    }
    for (auto step = chain.rbegin(); step != chain.rend(); ++step) {  // oldest delta first
      const std::string path = absl::StrCat(model_dir, "/", step->second->file);
      ASSIGN_OR_RETURN(const std::vector<uint8_t> delta, ReadDelta(path, *step->second));
      out.bytes_read += delta.size();
      const absl::Status applied = delta::Apply(delta.data(), delta.size(), bytes, piece.bytes);
      if (!applied.ok()) {
        // A wrong base is the caller's when we started from its copy; otherwise the bucket's
        // files don't fit together.
        const bool held = root_held != nullptr && step == chain.rbegin();
        return absl::Status(held && absl::IsFailedPrecondition(applied)
                                ? absl::StatusCode::kFailedPrecondition
                                : absl::StatusCode::kDataLoss,
                            absl::StrCat(path, ": ", applied.message()));
      }
    }
    if (XXH3_64bits(bytes, piece.bytes) != piece.xxh3) {
      return absl::DataLossError(
          absl::StrCat(label, "the reconstructed bytes do not match the manifest's checksum"));
    }
    ImportedPiece imported;
    imported.buffer_id = piece.buffer_id;
    imported.layout = piece.layout;
    imported.bytes = piece.bytes;
    imported.xxh3 = piece.xxh3;
    imported.region = std::move(region);
    out.pieces.push_back(std::move(imported));
  }
  return out;
}

absl::StatusOr<ImportedVersion> Importer::Materialize(const std::string& model, uint64_t version,
                                                      const ImportedVersion* base,
                                                      const Allocator& allocate) {
  auto result = MaterializeUnlogged(model, version, base, allocate);
  if (!result.ok()) {
    Reject(model, version, base != nullptr ? base->version : 0, result.status(), 0, 0);
    return result.status();
  }
  {
    common::MutexLock lock(mu_);
    rejected_.erase({model, version});
  }
  if (options_.metrics) {
    options_.metrics->Add(kBucketVersionsImported, 1);
    options_.metrics->Add(kBucketBytesRead, static_cast<double>(result->bytes_read));
  }
  return result;
}

void Importer::Reject(const std::string& model, uint64_t version, uint64_t base_version,
                      const absl::Status& status, int64_t mtime_ns, uint64_t size) {
  {
    common::MutexLock lock(mu_);
    Rejection& entry = rejected_[{model, version}];
    const std::string message = status.ToString();
    const bool repeated = entry.message == message && entry.base_version == base_version;
    entry.message = message;
    entry.base_version = base_version;
    entry.sticky = Sticky(status);
    if (mtime_ns != 0 || size != 0) {
      entry.manifest_mtime_ns = mtime_ns;
      entry.manifest_size = size;
    }
    if (repeated) return;
  }
  Logger("bucket")->error(
      "model={} version={} rejected from bucket {} (held: {}): {}", model, version, dir_,
      base_version != 0 ? absl::StrCat("version ", base_version) : "none", status.ToString());
  if (options_.metrics) options_.metrics->Add(kBucketRejected, 1);
}

absl::StatusOr<std::optional<ImportedVersion>> Importer::Next(const std::string& model,
                                                              const ImportedVersion* current,
                                                              const Allocator& allocate) {
  ASSIGN_OR_RETURN(const std::string model_dir, ModelDir(model));
  auto entries = internal::ListDir(model_dir);
  if (absl::IsNotFound(entries.status())) return std::optional<ImportedVersion>();
  if (!entries.ok()) return entries.status();
  const uint64_t held = current != nullptr ? current->version : 0;
  absl::Status first_error = absl::OkStatus();
  for (auto it = entries->rbegin(); it != entries->rend(); ++it) {
    if (it->is_dir || !IsManifestFileName(it->name)) continue;
    const uint64_t version = *VersionOfFileName(it->name);
    if (version <= held) break;
    {
      common::MutexLock lock(mu_);
      auto rejected = rejected_.find({model, version});
      if (rejected != rejected_.end() && rejected->second.sticky &&
          rejected->second.base_version == held &&
          rejected->second.manifest_mtime_ns == it->mtime_ns &&
          rejected->second.manifest_size == it->size) {
        continue;  // same files, same answer
      }
    }
    auto result = MaterializeUnlogged(model, version, current, allocate);
    if (result.ok()) {
      {
        common::MutexLock lock(mu_);
        rejected_.erase({model, version});
      }
      if (options_.metrics) {
        options_.metrics->Add(kBucketVersionsImported, 1);
        options_.metrics->Add(kBucketBytesRead, static_cast<double>(result->bytes_read));
      }
      return std::optional<ImportedVersion>(std::move(*result));
    }
    Reject(model, version, held, result.status(), it->mtime_ns, it->size);
    if (first_error.ok()) first_error = result.status();
    // Memory or I/O trouble would hit older versions just the same.
    if (!Sticky(result.status()) && !absl::IsNotFound(result.status())) break;
  }
  if (!first_error.ok()) return first_error;
  return std::optional<ImportedVersion>();
}

}  // namespace refit::bucket
