#include "daemon/bucket/bucket_sync.h"

#include <algorithm>
#include <filesystem>

#include "daemon/common/logging.h"

namespace refit::bucket {

BucketExport::BucketExport(std::string dir, ExporterOptions options, LocalSnapshots* store,
                           peer::DeltaSource* deltas, Metrics* metrics)
    : dir_(std::move(dir)),
      options_([&] {
        options.metrics = metrics;
        return options;
      }()),
      store_(store),
      deltas_(deltas),
      metrics_(metrics) {
  for (const Counter& counter :
       {kBucketVersionsExported, kBucketBytesWritten, kBucketFilesPruned, kBucketExportErrors}) {
    if (metrics_) metrics_->Declare(counter);
  }
  loop_.Start([this] { ExportAll(); });
}

BucketExport::~BucketExport() { Stop(); }

void BucketExport::Notify() { loop_.Notify(); }

void BucketExport::OnLocalVersionReady(const std::string& /*model*/, uint64_t /*version*/) {
  Notify();
}

void BucketExport::Stop() { loop_.Stop(); }

void BucketExport::ExportAll() {
  for (const auto& [model, layouts] : store_->LocalSourceLayouts()) {
    // With delta sync, wait until the version's deltas are ready: they go into the bucket.
    const uint64_t version = deltas_ && deltas_->enabled() ? deltas_->Prepared(model)
                                                           : store_->LatestLocalSnapshot(model);
    if (version == 0 || version <= exported_[model]) continue;
    Export(model, version);
  }
}

void BucketExport::Export(const std::string& model, uint64_t version) {
  auto snapshot = store_->GetLocalSnapshot(model, version);
  if (!snapshot.ok()) return;  // dropped meanwhile
  std::map<std::string, SourceLayout> layouts;
  const auto all_layouts = store_->LocalSourceLayouts();
  if (auto it = all_layouts.find(model); it != all_layouts.end()) {
    for (const SourceLayout& l : it->second) layouts[l.buffer_id] = l;
  }
  std::vector<peer::EncodedDelta> deltas;
  if (deltas_) deltas = deltas_->Deltas(model);
  std::vector<ExportPiece> pieces;
  for (const LocalSnapshot::Piece& p : (*snapshot)->pieces) {
    auto layout = layouts.find(p.buffer_id);
    if (layout == layouts.end() || p.slot->kind() != MemoryKind::kHost) {
      Logger("bucket")->warn(
          "model={} version={}: buffer {} can't be exported (no layout or "
          "not host memory)",
          model, version, p.buffer_id);
      return;
    }
    ExportPiece piece;
    piece.buffer_id = p.buffer_id;
    piece.layout = *layout->second.slices;
    piece.bytes = p.slot->size();
    piece.data = p.slot->data();
    for (const peer::EncodedDelta& d : deltas) {
      if (d.buffer_id == p.buffer_id && d.version == version &&
          d.base_version == exported_[model]) {
        piece.delta = d.bytes->data();
        piece.delta_size = d.bytes->size();
        piece.delta_base = d.base_version;
      }
    }
    pieces.push_back(std::move(piece));
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const ExportPiece& a, const ExportPiece& b) { return a.buffer_id < b.buffer_id; });
  auto& exporter = exporters_[model];
  if (!exporter) exporter = std::make_unique<Exporter>(dir_, options_);
  auto written = exporter->Write(model, version, pieces);
  if (!written.ok()) {  // the exporter logged what it wrote
    Logger("bucket")->error("model={} version={}: export to {} failed: {}", model, version, dir_,
                            written.status().ToString());
    // Not retried: the next version comes with the next Publish.
  }
  exported_[model] = version;
}

// ---------------------------------------------------------------------------------------------

BucketImport::BucketImport(std::string dir, VersionImports* store, Metrics* metrics)
    : dir_(dir), node_("bucket:" + dir), store_(store), metrics_(metrics), importer_(dir, [&] {
        ImporterOptions o;
        o.metrics = metrics;
        return o;
      }()) {
  for (const Counter& counter : {kBucketVersionsImported, kBucketBytesRead, kBucketRejected}) {
    if (metrics_) metrics_->Declare(counter);
  }
}

absl::StatusOr<std::unique_ptr<BucketImport>> BucketImport::Start(std::string dir,
                                                                  VersionImports* store,
                                                                  Metrics* metrics) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::FailedPreconditionError("--bucket-import=" + dir + ": " + error.message());
  }
  std::unique_ptr<BucketImport> self(new BucketImport(dir, store, metrics));
  BucketImport* raw = self.get();
  DirWatcherOptions options;
  options.max_depth = 1;  // DIR and the model directories in it
  auto watcher = DirWatcher::Start(dir, options, [raw] { raw->loop_.Notify(); });
  if (!watcher.ok()) return watcher.status();
  self->watcher_ = std::move(watcher).value();
  self->loop_.Start([raw] { raw->ImportAll(); });
  Logger("bucket")->info("following {} ({})", dir,
                         self->watcher_->using_inotify() ? "inotify and polling" : "polling");
  return self;
}

BucketImport::~BucketImport() { Stop(); }

void BucketImport::Stop() {
  if (watcher_) watcher_->Stop();
  loop_.Stop();
}

void BucketImport::ImportAll() {
  auto models = importer_.ListModels();
  if (!models.ok()) return;
  const Allocator allocate = [this](uint64_t bytes) { return store_->AcquireSlot(bytes); };
  for (const std::string& model : *models) {
    auto it = current_.find(model);
    auto next = importer_.Next(model, it == current_.end() ? nullptr : &it->second, allocate);
    if (!next.ok() || !next->has_value()) continue;  // rejections are logged by the importer
    ImportedVersion& version = **next;
    std::vector<SourceLayout> layouts;
    std::vector<std::shared_ptr<Region>> slots;
    for (const ImportedPiece& p : version.pieces) {
      layouts.push_back(
          {p.buffer_id, std::make_shared<const std::vector<TensorSlice>>(p.layout), p.bytes});
      slots.push_back(p.region);
    }
    Logger("bucket")->info("model={} version={} imported from {} ({} bytes read)", model,
                           version.version, dir_, version.bytes_read);
    store_->ImportVersion(node_, model, version.version, std::move(layouts), std::move(slots));
    current_[model] = std::move(version);
  }
}

}  // namespace refit::bucket
