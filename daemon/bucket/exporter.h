#pragma once

// The writing side of the storage bucket ("hub bucket" for sites that cannot reach each other
// directly): `refitd --bucket-export=DIR` hands every complete version of a model to an
// Exporter, which writes it to DIR as compressed full bytes or as deltas, plus a manifest.
// The importer (importer.h) on another node turns the directory back into versions.
//
//   Exporter exporter(dir, {.full_every = 8, .retain = 2});
//   ExportPiece piece{buffer_id, layout, bytes, slot->data()};
//   piece.delta = ...; piece.delta_base = N - 1;   // optional: delta::Encode(N-1, N)
//   exporter.Write("llama", N, {piece});           // data files, then the manifest, then prune
//
// What a version becomes (per piece): a delta file holding the caller's delta bytes as-is when
// the previous exported version of the model has the same pieces (buffer ids, sizes, layouts),
// the caller supplied a delta whose base is that previous version, and fewer than full_every - 1
// versions were written since the last version stored all in full; otherwise a full file (one
// zstd frame of the piece's bytes, compressed while streaming: memory stays O(MiB) whatever the
// piece's size). So a reader never applies more than full_every - 1 deltas in a row.
//
// Atomicity: every file is written under a temporary name (".tmp.*"), fsynced and renamed;
// the manifest is written last, so a version exists for readers only once all its files do.
// After the manifest, retention removes the files (manifests first) of versions no longer
// needed to reconstruct the newest `retain` versions: those, and every version their delta
// chains reach back to. Stray files of failed writes and stale temporary files go too.
//
// Restarts: on the first Write of a model, the Exporter reads the manifests already in DIR and
// continues from the newest one that parses (same version numbering, same delta chain).
// One Exporter per model directory: two writers of one model in one DIR are not supported.
// Pieces are matched with the previous version by position: pass them in a stable order (e.g.
// sorted by buffer id), or every version is stored in full.
//
// Thread-safety: Write may be called from any thread; calls are serialized by a mutex (one
// Write at a time, even for different models). Write blocks for the file I/O (seconds for GiBs
// on a network file system): call it from a worker thread, not under the store lock. The
// caller owns every byte; Write reads piece.data and piece.delta only until it returns.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/bucket/format.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/metrics/metrics.h"

namespace refit::bucket {

// Counters the bucket adds to Metrics (not part of docs/api.md's binding set).
inline constexpr Counter kBucketVersionsExported{"refit_bucket_versions_exported_total",
                                                 "--bucket-export: versions written."};
inline constexpr Counter kBucketBytesWritten{"refit_bucket_bytes_written_total",
                                             "--bucket-export: file bytes written."};
inline constexpr Counter kBucketFilesPruned{"refit_bucket_files_pruned_total",
                                            "--bucket-export: old files removed."};
inline constexpr Counter kBucketExportErrors{"refit_bucket_export_errors_total",
                                             "--bucket-export: failed writes."};

// full_every and retain have no default here: refitd sets them from --bucket-full-every and
// --retain (DaemonOptions, where their defaults live); Write refuses them unset (0).
struct ExporterOptions {
  uint32_t full_every = 0;  // K >= 1: at most K - 1 deltas between two all-full versions
  uint32_t retain = 0;      // >= 1: the newest versions kept reconstructible
  int zstd_level = 1;       // full files; negative values are zstd's fast levels
  int zstd_workers = 0;     // zstd's own threads for large pieces (0: compress on the caller)
  bool fsync = true;        // fsync files and the directory (off only in tests)
  // Temporary files older than this are left-overs of a crashed writer and are removed.
  int64_t stale_temp_seconds = 3600;
  Metrics* metrics = nullptr;  // optional; not owned
};

// One SOURCE buffer's bytes in version N.
struct ExportPiece {
  std::string buffer_id;
  std::vector<TensorSlice> layout;  // buffer_offset relative to `data`
  uint64_t bytes = 0;
  const uint8_t* data = nullptr;  // `bytes` bytes of version N; not owned
  // Optional: delta::Encode(base = version delta_base's bytes, target = data). Not owned.
  const uint8_t* delta = nullptr;
  uint64_t delta_size = 0;
  uint64_t delta_base = 0;
};

// What Write did.
struct ExportResult {
  Manifest manifest;                // as written
  uint64_t bytes_written = 0;       // data files plus manifest
  std::vector<std::string> pruned;  // file names removed by retention
};

class Exporter {
 public:
  // `dir` is created on the first Write if missing. Options are checked there too.
  Exporter(std::string dir, ExporterOptions options);
  ~Exporter();
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  // Writes version `version` of `model`. INVALID_ARGUMENT for bad pieces or options;
  // FAILED_PRECONDITION when `version` is not newer than the newest version of the model in
  // DIR; I/O errors as file_io.h maps them. On error nothing new is visible to readers (the
  // data files already written are removed; what a crash leaves behind goes with a later
  // Write's cleanup), and the next Write continues from the last version whose manifest was
  // written.
  absl::StatusOr<ExportResult> Write(const std::string& model, uint64_t version,
                                     const std::vector<ExportPiece>& pieces);

  const std::string& dir() const { return dir_; }

 private:
  // What the exporter remembers of a version it wrote or found in DIR.
  struct VersionInfo {
    bool all_full = false;
    std::set<uint64_t> bases;        // versions the delta pieces apply to
    std::vector<std::string> files;  // data files (the manifest's name follows from the version)
  };
  struct ModelState {
    std::string dir_name;
    bool loaded = false;
    std::map<uint64_t, VersionInfo> versions;
    std::optional<Manifest> newest;  // the newest manifest that parsed
    uint32_t since_full = 0;         // versions written since the last all-full one
  };

  absl::Status LoadModel(const std::string& model, ModelState& state);
  absl::StatusOr<ExportResult> WriteLocked(const std::string& model, uint64_t version,
                                           const std::vector<ExportPiece>& pieces,
                                           ModelState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> Prune(const std::string& model_dir, ModelState& state);

  const std::string dir_;
  const ExporterOptions options_;
  common::Mutex mu_;
  std::map<std::string, ModelState> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::bucket
