#pragma once

// The reading side of the storage bucket: `refitd --bucket-import=DIR` follows a directory an
// Exporter (exporter.h) writes (usually with a DirWatcher, dir_watcher.h) and turns its
// versions back into complete pieces in memory, as if a peer had sent them.
//
//   Importer importer(dir, {.metrics = &metrics});
//   std::optional<ImportedVersion> current;                  // what the node holds now
//   watcher callback:  auto next = importer.Next("llama", current ? &*current : nullptr, alloc);
//                      if (next.ok() && *next) { hand (*next)->pieces to the store; current = ... }
//
// Materialize(model, N, base) reconstructs version N: a full piece is decompressed straight
// into memory from the allocator; a delta piece starts from the caller's `base` when N's delta
// applies to it, or else walks back to the nearest version holding that piece in full and
// applies the chain of deltas forwards, in place, in one buffer per piece.
//
// Checks: the manifest (JSON, self-checksum, fields, safe file names), each file's size and
// XXH3, the zstd frame (content size, no trailing bytes), each delta's index (daemon/delta:
// ParseIndex; Apply is all-or-nothing and checks every chunk's target checksum), and last the
// XXH3 of every reconstructed piece against the manifest. A failure returns an error and
// nothing else: the caller keeps the version it has. Codes: DATA_LOSS for corrupt, truncated or
// inconsistent files; NOT_FOUND for a missing manifest or data file (e.g. pruned meanwhile:
// retry with a newer version); FAILED_PRECONDITION when a delta's base is gone and the caller
// doesn't hold it; UNIMPLEMENTED for a newer format; RESOURCE_EXHAUSTED when a version exceeds
// max_version_bytes or the allocator fails; I/O errors as file_io.h maps them.
//
// Each distinct rejection is logged once (logger "bucket", one line with model, version and
// the reason) and counted once in refit_bucket_rejected_total.
//
// Memory: every piece gets a fresh region from the caller's allocator (host memory: the
// importer writes it with the CPU); the returned ImportedVersion holds the only references the
// importer took. The caller's base is only read (copied) and may be shared with readers.
//
// Thread-safety: all methods may be called from any thread, concurrently (the rejection log
// has its own mutex). Materialize and Next block on file I/O: call them from a worker thread.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/bucket/format.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/metrics/metrics.h"

namespace refit::bucket {

inline constexpr Counter kBucketVersionsImported{
    "refit_bucket_versions_imported_total",
    "--bucket-import: versions completed from the directory."};
inline constexpr Counter kBucketBytesRead{"refit_bucket_bytes_read_total",
                                          "--bucket-import: file bytes read."};
inline constexpr Counter kBucketRejected{"refit_bucket_rejected_total",
                                         "--bucket-import: corrupt or partial versions refused."};

// Gives `bytes` bytes of writable host memory for one piece (e.g. a SlotPool slot, or
// refit::AllocateHost in tests).
using Allocator = std::function<absl::StatusOr<std::shared_ptr<Region>>(uint64_t bytes)>;

struct ImportedPiece {
  std::string buffer_id;
  std::vector<TensorSlice> layout;  // normalized; buffer_offset relative to the region's start
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;               // of the piece's bytes (verified)
  std::shared_ptr<Region> region;  // at least `bytes` bytes; the piece is region->data()[0, bytes)
};

struct ImportedVersion {
  std::string model;
  uint64_t version = 0;
  std::vector<ImportedPiece> pieces;  // in the manifest's order
  uint64_t bytes_read = 0;            // file bytes read to build it
};

struct ImporterOptions {
  // A version whose pieces add up to more is refused (RESOURCE_EXHAUSTED) before any memory is
  // allocated: a forged manifest can't make the daemon allocate without bound.
  uint64_t max_version_bytes = uint64_t{1} << 40;
  Metrics* metrics = nullptr;  // optional; not owned
};

class Importer {
 public:
  Importer(std::string dir, ImporterOptions options = {});
  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;

  // Models with a directory in DIR, by name (decoded from the directory name, or read from a
  // manifest for hashed long names). NOT_FOUND when DIR doesn't exist.
  absl::StatusOr<std::vector<std::string>> ListModels() const;
  // Versions of `model` whose manifest is present and parses, oldest first (reads every
  // manifest; Next uses the file names only). Empty when the model has no directory.
  absl::StatusOr<std::vector<uint64_t>> ListVersions(const std::string& model) const;
  // Reads and checks one manifest (it must name `model` and `version`).
  absl::StatusOr<Manifest> ReadManifest(const std::string& model, uint64_t version) const;

  // Reconstructs version `version` of `model` (see above). `base` (optional, may be any
  // version the caller holds) is read only. Logs and counts a rejection (once per distinct one).
  absl::StatusOr<ImportedVersion> Materialize(const std::string& model, uint64_t version,
                                              const ImportedVersion* base,
                                              const Allocator& allocate);

  // The newest version of `model` newer than `current` (null: none held) that materializes:
  // tries the newest first and falls back to older ones newer than `current` when it is
  // rejected. nullopt when nothing newer exists, or everything newer was rejected before
  // (a rejected version is tried again only when its manifest file changes, or, for NOT_FOUND
  // and I/O errors, on every call). An error when this call tried and failed.
  absl::StatusOr<std::optional<ImportedVersion>> Next(const std::string& model,
                                                      const ImportedVersion* current,
                                                      const Allocator& allocate);

  const std::string& dir() const { return dir_; }

 private:
  struct Rejection {
    std::string message;
    uint64_t base_version = 0;
    int64_t manifest_mtime_ns = 0;
    uint64_t manifest_size = 0;
    bool sticky = false;  // corrupt rather than missing: don't retry the same manifest
  };

  absl::StatusOr<ImportedVersion> MaterializeUnlogged(const std::string& model, uint64_t version,
                                                      const ImportedVersion* base,
                                                      const Allocator& allocate) const;
  // Logs and counts `status` for (model, version) unless it was the last one recorded.
  void Reject(const std::string& model, uint64_t version, uint64_t base_version,
              const absl::Status& status, int64_t mtime_ns, uint64_t size);
  absl::StatusOr<std::string> ModelDir(const std::string& model) const;

  const std::string dir_;
  const ImporterOptions options_;
  common::Mutex mu_;
  std::map<std::pair<std::string, uint64_t>, Rejection> rejected_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::bucket
