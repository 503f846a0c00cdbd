#pragma once

// The daemon's side of the storage bucket: two workers that connect the store to a directory.
//
// BucketExport (--bucket-export=DIR): whenever every local SOURCE buffer of a model has
// published a new version and its deltas are ready (DeltaSource), writes it with an Exporter
// per model — the deltas DeltaSource made for peers are written as they are, so the bucket
// costs no second encoding — and a full base every --bucket-full-every versions.
//
// BucketImport (--bucket-import=DIR): follows DIR with a DirWatcher (inotify, plus polling for
// network file systems) and hands every new version that materializes and verifies to the
// store (Store::ImportVersion) as if a peer had sent it. A corrupt or partial file is rejected
// by the Importer (one log line, refit_bucket_rejected_total) and the node stays where it was.
//
// BucketExport listens to the store (StoreEvents): OnLocalVersionReady wakes it, as does
// DeltaSource's "prepared" (daemon/wiring.cc).
//
// Thread-safety: each worker runs one thread of its own; Notify() may be called from any
// thread (the store calls it, through OnLocalVersionReady, with its lock held: it only sets a
// flag).

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/bucket/dir_watcher.h"
#include "daemon/bucket/exporter.h"
#include "daemon/bucket/importer.h"
#include "daemon/common/worker_loop.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/delta_source.h"
#include "daemon/store/local_snapshots.h"
#include "daemon/store/store_types.h"
#include "daemon/store/version_imports.h"

namespace refit::bucket {

class BucketExport final : public StoreEvents {
 public:
  // `deltas` may be null (no delta sync: every version is written in full). `options`: what
  // each model's Exporter writes with (full_every and retain >= 1, or every Write fails
  // INVALID_ARGUMENT; its metrics are `metrics`).
  BucketExport(std::string dir, ExporterOptions options, LocalSnapshots* store,
               peer::DeltaSource* deltas, Metrics* metrics);
  ~BucketExport() override;  // Stop()
  BucketExport(const BucketExport&) = delete;
  BucketExport& operator=(const BucketExport&) = delete;

  void Notify();
  void Stop();

  // StoreEvents: a new local version is a version to write; it reads the version's snapshot.
  void OnLocalVersionReady(const std::string& model, uint64_t version) override;
  bool WantsLocalSnapshots() const override { return true; }

 private:
  void ExportAll();
  void Export(const std::string& model, uint64_t version);

  const std::string dir_;
  const ExporterOptions options_;
  LocalSnapshots* const store_;
  peer::DeltaSource* const deltas_;
  Metrics* const metrics_;

  // Worker thread only.
  std::map<std::string, std::unique_ptr<Exporter>> exporters_;  // by model
  std::map<std::string, uint64_t> exported_;                    // newest version written
  WorkerLoop loop_{"bucket export"};                            // runs ExportAll
};

class BucketImport {
 public:
  // Creates DIR if missing and starts following it; errors when it can't.
  static absl::StatusOr<std::unique_ptr<BucketImport>> Start(std::string dir, VersionImports* store,
                                                             Metrics* metrics);
  ~BucketImport();  // Stop()
  BucketImport(const BucketImport&) = delete;
  BucketImport& operator=(const BucketImport&) = delete;

  void Stop();
  // The node name the store knows the bucket by: "bucket:DIR".
  const std::string& node() const { return node_; }

 private:
  BucketImport(std::string dir, VersionImports* store, Metrics* metrics);
  void ImportAll();

  const std::string dir_;
  const std::string node_;
  VersionImports* const store_;
  Metrics* const metrics_;
  Importer importer_;

  // Worker thread only: the newest version imported per model (the base for its deltas).
  std::map<std::string, ImportedVersion> current_;
  std::unique_ptr<DirWatcher> watcher_;  // notifies loop_
  // Runs ImportAll: once at start, then whenever the watcher sees a change.
  WorkerLoop loop_{WorkerLoop::Options{"bucket import", std::chrono::milliseconds(0),
                                       /*run_at_start=*/true}};
};

}  // namespace refit::bucket
