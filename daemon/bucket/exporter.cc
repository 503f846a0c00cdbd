#include "daemon/bucket/exporter.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/bucket/file_io.h"
#include "daemon/bucket/full_codec.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/xxh3.h"
#include "daemon/delta/delta.h"
#include "daemon/plan/plan.h"

namespace refit::bucket {
namespace {

using internal::WriteFileAtomically;

absl::Status CheckPieces(const std::vector<ExportPiece>& pieces, uint64_t version) {
  if (pieces.empty()) return absl::InvalidArgumentError("a version needs at least one piece");
  std::set<std::string> ids;
  for (const ExportPiece& piece : pieces) {
    const std::string label = absl::StrCat("buffer ", piece.buffer_id, ": ");
    if (piece.buffer_id.empty() || !ids.insert(piece.buffer_id).second) {
      return absl::InvalidArgumentError(label + "empty or repeated buffer id");
    }
    if (piece.bytes == 0 || piece.data == nullptr) {
      return absl::InvalidArgumentError(label + "no bytes");
    }
    if (piece.delta != nullptr && (piece.delta_size == 0 || piece.delta_base >= version)) {
      return absl::InvalidArgumentError(label + "empty delta or delta base not older");
    }
    std::vector<TensorSlice> layout = piece.layout;
    absl::Status valid = plan::NormalizeAndValidateBuffer(layout, piece.bytes);
    if (!valid.ok()) return absl::InvalidArgumentError(label + std::string(valid.message()));
  }
  return absl::OkStatus();
}

// The caller's delta, if it is usable as piece `piece` of a version following `prev`.
bool UsableDelta(const ExportPiece& piece, const ManifestPiece& prev, uint64_t prev_version,
                 const std::string& model, uint64_t version) {
  if (piece.delta == nullptr || piece.delta_base != prev_version) return false;
  auto index = delta::ParseIndex(piece.delta, piece.delta_size);
  if (!index.ok() || index->total_size != piece.delta_size ||
      index->buffer_bytes() != piece.bytes || prev.bytes != piece.bytes) {
    Logger("bucket")->warn(
        "model={} version={} buffer={}: the delta does not fit the piece ({}); storing it in full",
        model, version, piece.buffer_id,
        index.ok() ? "size mismatch" : std::string(index.status().message()));
    return false;
  }
  return true;
}

uint64_t NowUnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

Exporter::Exporter(std::string dir, ExporterOptions options)
    : dir_(std::move(dir)), options_(options) {}

Exporter::~Exporter() = default;

absl::StatusOr<ExportResult> Exporter::Write(const std::string& model, uint64_t version,
                                             const std::vector<ExportPiece>& pieces) {
  common::MutexLock lock(mu_);
  if (options_.full_every < 1 || options_.retain < 1) {
    return absl::InvalidArgumentError("bucket export: full_every and retain must be >= 1");
  }
  if (version == 0) return absl::InvalidArgumentError("bucket export: version 0");
  RETURN_IF_ERROR(CheckPieces(pieces, version));
  ASSIGN_OR_RETURN(const std::string dir_name, ModelDirName(model));
  ModelState& state = models_[model];
  state.dir_name = dir_name;
  if (!state.loaded) {
    RETURN_IF_ERROR(LoadModel(model, state));
    state.loaded = true;
  }
  if (!state.versions.empty() && version <= state.versions.rbegin()->first) {
    return absl::FailedPreconditionError(
        absl::StrCat("bucket export: model ", model, " version ", version,
                     " is not newer than version ", state.versions.rbegin()->first, " in ", dir_));
  }
  auto result = WriteLocked(model, version, pieces, state);
  if (!result.ok()) {
    Logger("bucket")->error("model={} version={} bucket export failed: {}", model, version,
                            result.status().ToString());
    if (options_.metrics) options_.metrics->Add(kBucketExportErrors, 1);
  }
  return result;
}

absl::StatusOr<ExportResult> Exporter::WriteLocked(const std::string& model, uint64_t version,
                                                   const std::vector<ExportPiece>& pieces,
                                                   ModelState& state) {
  const std::string model_dir = absl::StrCat(dir_, "/", state.dir_name);
  RETURN_IF_ERROR(internal::MakeDirs(model_dir));

  // The previous version, if the new one may be stored as deltas against it.
  const Manifest* prev = nullptr;
  if (state.newest && state.newest->version == state.versions.rbegin()->first &&
      state.newest->pieces.size() == pieces.size()) {
    prev = &*state.newest;
    for (size_t i = 0; i < pieces.size() && prev != nullptr; ++i) {
      std::vector<TensorSlice> layout = pieces[i].layout;
      const bool normalized = plan::NormalizeAndValidateBuffer(layout, pieces[i].bytes).ok();
      const ManifestPiece& old = prev->pieces[i];
      if (!normalized || old.buffer_id != pieces[i].buffer_id || old.bytes != pieces[i].bytes ||
          !SameLayout(old.layout, layout)) {
        prev = nullptr;
      }
    }
  }
  const bool force_full = prev == nullptr || state.since_full + 1 >= options_.full_every;

  ExportResult result;
  Manifest& manifest = result.manifest;
  manifest.model = model;
  manifest.version = version;
  manifest.created_unix_ms = NowUnixMs();
  std::vector<std::string> written;
  absl::Status status = [&]() -> absl::Status {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const ExportPiece& piece = pieces[i];
      ManifestPiece out;
      out.buffer_id = piece.buffer_id;
      out.layout = piece.layout;
      RETURN_IF_ERROR(plan::NormalizeAndValidateBuffer(out.layout, piece.bytes));
      out.bytes = piece.bytes;
      const bool delta =
          !force_full && UsableDelta(piece, prev->pieces[i], prev->version, model, version);
      out.kind = delta ? PieceKind::kDelta : PieceKind::kFull;
      out.file = DataFileName(version, i, out.kind);
      if (delta) {
        out.base_version = piece.delta_base;
        out.xxh3 = XXH3_64bits(piece.data, piece.bytes);
        out.file_bytes = piece.delta_size;
        out.file_xxh3 = XXH3_64bits(piece.delta, piece.delta_size);
        RETURN_IF_ERROR(WriteFileAtomically(model_dir, out.file, options_.fsync, [&](int fd) {
          return internal::WriteAll(fd, piece.delta, piece.delta_size, out.file);
        }));
      } else {
        RETURN_IF_ERROR(WriteFileAtomically(model_dir, out.file, options_.fsync, [&](int fd) {
          ASSIGN_OR_RETURN(auto compressed,
                           internal::CompressToFd(fd, out.file, piece.data, piece.bytes,
                                                  options_.zstd_level, options_.zstd_workers));
          out.xxh3 = compressed.data_xxh3;
          out.file_bytes = compressed.file_bytes;
          out.file_xxh3 = compressed.file_xxh3;
          return absl::OkStatus();
        }));
      }
      written.push_back(out.file);
      result.bytes_written += out.file_bytes;
      manifest.pieces.push_back(std::move(out));
    }
    ASSIGN_OR_RETURN(const std::string text, SerializeManifest(manifest));
    RETURN_IF_ERROR(WriteFileAtomically(
        model_dir, ManifestFileName(version), options_.fsync,
        [&](int fd) { return internal::WriteAll(fd, text.data(), text.size(), model_dir); }));
    result.bytes_written += text.size();
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    for (const std::string& name : written) {
      internal::RemoveFile(absl::StrCat(model_dir, "/", name)).IgnoreError();
    }
    return status;
  }
  RETURN_IF_ERROR(CheckManifest(manifest));  // normalizes the layouts, as a reader sees them

  VersionInfo info;
  info.all_full = manifest.AllFull();
  for (const ManifestPiece& piece : manifest.pieces) {
    if (piece.kind == PieceKind::kDelta) info.bases.insert(piece.base_version);
    info.files.push_back(piece.file);
  }
  state.versions[version] = std::move(info);
  state.since_full = manifest.AllFull() ? 0 : state.since_full + 1;
  state.newest = manifest;

  result.pruned = Prune(model_dir, state);
  size_t deltas = 0;
  for (const ManifestPiece& piece : manifest.pieces) deltas += piece.kind == PieceKind::kDelta;
  Logger("bucket")->info(
      "model={} version={} exported to {}: {} full, {} delta pieces, {} bytes; pruned {} files",
      model, version, model_dir, manifest.pieces.size() - deltas, deltas, result.bytes_written,
      result.pruned.size());
  if (options_.metrics) {
    options_.metrics->Add(kBucketVersionsExported, 1);
    options_.metrics->Add(kBucketBytesWritten, static_cast<double>(result.bytes_written));
    options_.metrics->Add(kBucketFilesPruned, static_cast<double>(result.pruned.size()));
  }
  return result;
}

absl::Status Exporter::LoadModel(const std::string& model, ModelState& state) {
  const std::string model_dir = absl::StrCat(dir_, "/", state.dir_name);
  auto entries = internal::ListDir(model_dir);
  if (!entries.ok()) {
    return absl::IsNotFound(entries.status()) ? absl::OkStatus() : entries.status();
  }
  for (const internal::DirEntry& entry : *entries) {
    if (entry.is_dir || !IsManifestFileName(entry.name)) continue;
    const uint64_t version = *VersionOfFileName(entry.name);
    auto text =
        internal::ReadSmallFile(absl::StrCat(model_dir, "/", entry.name), kMaxManifestBytes);
    auto manifest = text.ok() ? ParseManifest(*text) : absl::StatusOr<Manifest>(text.status());
    if (manifest.ok() && (manifest->model != model || manifest->version != version)) {
      manifest = absl::DataLossError("names another model or version");
    }
    VersionInfo info;
    if (!manifest.ok()) {
      // Kept in the numbering (so it is never overwritten) and pruned like any other version.
      Logger("bucket")->warn("model={} version={}: ignoring unreadable manifest in {}: {}", model,
                             version, model_dir, manifest.status().ToString());
      state.versions[version] = std::move(info);
      continue;
    }
    info.all_full = manifest->AllFull();
    for (const ManifestPiece& piece : manifest->pieces) {
      if (piece.kind == PieceKind::kDelta) info.bases.insert(piece.base_version);
      info.files.push_back(piece.file);
    }
    state.versions[version] = std::move(info);
    state.newest = std::move(*manifest);  // entries are sorted: the last one is the newest
  }
  state.since_full = 0;
  for (auto it = state.versions.rbegin(); it != state.versions.rend() && !it->second.all_full;
       ++it) {
    ++state.since_full;
  }
  if (!state.versions.empty()) {
    Logger("bucket")->info("model={} continuing the bucket in {} after version {}", model,
                           model_dir, state.versions.rbegin()->first);
  }
  return absl::OkStatus();
}

std::vector<std::string> Exporter::Prune(const std::string& model_dir, ModelState& state) {
  std::set<uint64_t> keep;
  std::vector<uint64_t> queue;
  for (auto it = state.versions.rbegin();
       it != state.versions.rend() && keep.size() < options_.retain; ++it) {
    keep.insert(it->first);
    queue.push_back(it->first);
  }
  while (!queue.empty()) {  // every version a kept delta chain reaches back to
    const uint64_t version = queue.back();
    queue.pop_back();
    for (const uint64_t base : state.versions[version].bases) {
      if (state.versions.count(base) != 0 && keep.insert(base).second) queue.push_back(base);
    }
  }
  std::vector<std::string> pruned;
  auto remove = [&](const std::string& name) {
    absl::Status removed = internal::RemoveFile(absl::StrCat(model_dir, "/", name));
    if (removed.ok()) {
      pruned.push_back(name);
    } else {
      Logger("bucket")->warn("bucket retention: {}", removed.ToString());
    }
  };
  for (auto it = state.versions.begin(); it != state.versions.end();) {
    if (keep.count(it->first) != 0) {
      ++it;
      continue;
    }
    // The manifest goes first, so a reader never finds a version with files missing by design.
    remove(ManifestFileName(it->first));
    for (const std::string& file : it->second.files) remove(file);
    it = state.versions.erase(it);
  }
  // Strays: data files of failed writes, files of versions pruned by an earlier process, and
  // temporary files of a writer that crashed.
  const uint64_t newest = state.versions.rbegin()->first;
  auto entries = internal::ListDir(model_dir);
  if (!entries.ok()) return pruned;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  for (const internal::DirEntry& entry : *entries) {
    if (entry.is_dir) continue;
    if (entry.name.rfind(kTempPrefix, 0) == 0) {
      if (now_ns - entry.mtime_ns > options_.stale_temp_seconds * 1000000000) remove(entry.name);
      continue;
    }
    auto version = VersionOfFileName(entry.name);
    if (version && *version < newest && keep.count(*version) == 0) remove(entry.name);
  }
  return pruned;
}

}  // namespace refit::bucket
