#include "daemon/peer/delta_source.h"

#include <chrono>
#include <cstring>

#include "daemon/common/logging.h"
#include "daemon/delta/delta.h"

namespace refit::peer {
namespace {

// The fraction of bytes that differ in 256 evenly spread samples of 256 bytes: a version where
// nearly everything changed (a fresh initialization, a large step) is not worth encoding, and
// finding that out from samples costs microseconds instead of a scan of the whole buffer.
double SampledChangedFraction(const uint8_t* base, const uint8_t* target, uint64_t bytes) {
  constexpr uint64_t kSamples = 256, kSampleBytes = 256;
  if (bytes < kSamples * kSampleBytes) return 0;  // small: just encode it
  uint64_t changed = 0;
  for (uint64_t i = 0; i < kSamples; ++i) {
    const uint64_t at = (bytes - kSampleBytes) / (kSamples - 1) * i;
    for (uint64_t b = 0; b < kSampleBytes; ++b) changed += base[at + b] != target[at + b];
  }
  return static_cast<double>(changed) / static_cast<double>(kSamples * kSampleBytes);
}

}  // namespace

DType DeltaDType(const std::vector<TensorSlice>& slices, uint64_t bytes) {
  if (slices.empty()) return DType::kUINT8;
  const DType dtype = slices.front().dtype;
  const uint64_t size = DTypeSize(dtype);
  if (size == 0 || bytes % size != 0) return DType::kUINT8;
  for (const TensorSlice& s : slices) {
    if (s.dtype != dtype || s.buffer_offset % size != 0) return DType::kUINT8;
  }
  return dtype;
}

DeltaSource::DeltaSource(LocalSnapshots* store, DeltaSourceOptions options, Metrics* metrics,
                         std::function<void()> ready)
    : store_(store), options_(options), metrics_(metrics), ready_(std::move(ready)) {
  metrics_->Declare(kDeltaEncodedBytes);
  metrics_->Declare(kDeltaEncodeSeconds);
  if (enabled()) loop_.Start([this] { Step(); });
}

DeltaSource::~DeltaSource() { Stop(); }

void DeltaSource::Notify() { loop_.Notify(); }

void DeltaSource::OnLocalVersionReady(const std::string& /*model*/, uint64_t /*version*/) {
  Notify();
}

void DeltaSource::Stop() { loop_.Stop(); }

uint64_t DeltaSource::Prepared(const std::string& model) const {
  if (!enabled()) return store_->LatestLocalSnapshot(model);
  common::MutexLock lock(mu_);
  auto it = prepared_.find(model);
  return it == prepared_.end() ? 0 : it->second;
}

std::vector<EncodedDelta> DeltaSource::Deltas(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = deltas_.find(model);
  return it == deltas_.end() ? std::vector<EncodedDelta>() : it->second;
}

void DeltaSource::Step() {
  bool any = false;
  for (const auto& [model, layouts] : store_->LocalSourceLayouts()) {
    const uint64_t newest = store_->LatestLocalSnapshot(model);
    if (newest == 0) continue;
    // A new run (a resume from a checkpoint) may restart below the version prepared last.
    std::string prepared_run;
    {
      common::MutexLock lock(mu_);
      auto it = prepared_run_.find(model);
      if (it != prepared_run_.end()) prepared_run = it->second;
    }
    if (newest <= Prepared(model) && prepared_run == store_->RunOf(model)) continue;
    Prepare(model, layouts);
    any = true;
  }
  if (any && ready_) ready_();
}

void DeltaSource::Prepare(const std::string& model, const std::vector<SourceLayout>& layouts) {
  const uint64_t version = store_->LatestLocalSnapshot(model);
  auto snapshot = store_->GetLocalSnapshot(model, version);
  if (!snapshot.ok()) return;  // dropped meanwhile; the next one comes
  std::shared_ptr<const LocalSnapshot> previous = last_[model];
  const bool new_run = previous && previous->run != (*snapshot)->run;
  if (new_run) previous = nullptr;  // deltas chain versions of one run only
  std::vector<EncodedDelta> made;
  for (const LocalSnapshot::Piece& piece : (*snapshot)->pieces) {
    const LocalSnapshot::Piece* base = nullptr;
    if (previous) {
      for (const LocalSnapshot::Piece& p : previous->pieces) {
        if (p.buffer_id == piece.buffer_id && p.slot->size() == piece.slot->size()) base = &p;
      }
    }
    const SourceLayout* layout = nullptr;
    for (const SourceLayout& l : layouts) {
      if (l.buffer_id == piece.buffer_id) layout = &l;
    }
    if (!base || !layout || piece.slot->kind() != MemoryKind::kHost ||
        base->slot->kind() != MemoryKind::kHost) {
      continue;  // receivers pull this piece in full
    }
    const uint64_t bytes = piece.slot->size();
    if (SampledChangedFraction(base->slot->data(), piece.slot->data(), bytes) > 0.5) {
      Logger("delta")->debug("model={} version={} buffer={}: most bytes changed; no delta", model,
                             version, piece.buffer_id);
      continue;
    }
    delta::EncodeOptions options;
    options.chunk_elements = options_.chunk_elements;
    options.threads = options_.threads;
    options.max_encoded_bytes = std::max<uint64_t>(
        1, static_cast<uint64_t>(options_.threshold * static_cast<double>(bytes)));
    const auto start = std::chrono::steady_clock::now();
    auto encoded = delta::Encode(base->slot->data(), piece.slot->data(), bytes,
                                 DeltaDType(*layout->slices, bytes), options);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics_->Observe(kDeltaEncodeSeconds, seconds);
    if (!encoded.ok()) {
      Logger("delta")->info(
          "model={} version={} buffer={}: no delta ({}); receivers pull it in full", model, version,
          piece.buffer_id, std::string(encoded.status().message()));
      continue;
    }
    auto region = AllocateHost(encoded->size());
    if (!region.ok()) {
      Logger("delta")->warn("model={} version={}: no memory for a delta: {}", model, version,
                            region.status().ToString());
      continue;
    }
    std::memcpy((*region)->data(), encoded->data(), encoded->size());
    metrics_->Add(kDeltaEncodedBytes, static_cast<double>(encoded->size()));
    Logger("delta")->debug(
        "model={} version={} buffer={}: delta of {} bytes from version {} "
        "({:.1f}x smaller) in {:.3f} s",
        model, version, piece.buffer_id, encoded->size(), previous->version,
        static_cast<double>(bytes) / static_cast<double>(encoded->size()), seconds);
    made.push_back({piece.buffer_id, previous->version, version,
                    std::shared_ptr<Region>(std::move(region).value())});
  }
  last_[model] = *snapshot;
  common::MutexLock lock(mu_);
  auto& held = deltas_[model];
  const auto retire_at = std::chrono::steady_clock::now();
  if (new_run) {
    for (const EncodedDelta& d : held) retired_.emplace_back(retire_at, d.bytes);
    held.clear();
  }
  held.insert(held.end(), made.begin(), made.end());
  // Keep the newest `chain` deltas of each piece the model still has. A delta dropped here may
  // have been announced to a receiver that hasn't read it yet: it stays allocated for a pin's
  // lease (a receiver's reads of freed memory would be served by this node's data plane).
  const auto now = std::chrono::steady_clock::now();
  std::map<std::string, uint32_t> kept;
  for (const LocalSnapshot::Piece& piece : (*snapshot)->pieces) kept[piece.buffer_id] = 0;
  std::vector<EncodedDelta> trimmed;
  for (auto it = held.rbegin(); it != held.rend(); ++it) {
    auto count = kept.find(it->buffer_id);
    if (count != kept.end() && count->second++ < std::max<uint32_t>(1, options_.chain)) {
      trimmed.push_back(*it);
    } else {
      retired_.emplace_back(now, it->bytes);
    }
  }
  held.assign(trimmed.rbegin(), trimmed.rend());
  while (!retired_.empty() && now - retired_.front().first > kRetiredGrace) retired_.pop_front();
  prepared_[model] = version;
  prepared_run_[model] = (*snapshot)->run;
  prepared_snapshot_[model] = *snapshot;
}

std::shared_ptr<const LocalSnapshot> DeltaSource::PreparedSnapshot(const std::string& model,
                                                                   uint64_t version) const {
  common::MutexLock lock(mu_);
  auto it = prepared_snapshot_.find(model);
  if (it == prepared_snapshot_.end() || it->second->version != version) return nullptr;
  return it->second;
}

}  // namespace refit::peer
