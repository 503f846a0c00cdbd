// The store's side of fp8 destinations with block scales: RegisterBuffer's layout checks, the
// quantizer thread that quantizes a version before it completes (partly while its local pieces
// are still being published), and the derived slot Apply copies from (quantize.h).
#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/scales.h"
#include "daemon/store/store_internal.h"

namespace refit {

absl::Status CheckScaleLayout(const std::string& model, Role role,
                              const std::vector<TensorSlice>& slices,
                              const std::map<std::string, const TensorSlice*>& source_of,
                              const std::multimap<std::string, const TensorSlice*>& dest_of,
                              const std::multimap<std::string, const TensorSlice*>& scaled_by) {
  if (role == Role::kSource) {
    for (const TensorSlice& s : slices) {
      if (scaled_by.count(s.name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", s.name, " is the scale tensor of ", scaled_by.find(s.name)->second->name,
            " in model ", model, ": its scales come from quantization, never from a source"));
      }
    }
    return absl::OkStatus();
  }
  // The request's own slices by name, and its scaled slices by scale tensor.
  std::multimap<std::string, const TensorSlice*> named;
  std::multimap<std::string, const TensorSlice*> scaled_here;  // fp8 slices by scale tensor
  for (const TensorSlice& s : slices) {
    named.emplace(s.name, &s);
    if (plan::IsScaled(s)) scaled_here.emplace(s.scale_tensor, &s);
  }
  for (const TensorSlice& s : slices) {
    // A slice of a scale tensor that fp8 slices (earlier or in this request) name.
    using ByScale = std::multimap<std::string, const TensorSlice*>;
    const ByScale* both[] = {&scaled_by, &scaled_here};
    for (const ByScale* by : both) {
      auto [first, last] = by->equal_range(s.name);
      for (auto it = first; it != last; ++it) {
        RETURN_IF_ERROR(plan::CheckScaleSlice(*it->second, s));
      }
    }
    if (!plan::IsScaled(s)) continue;
    if (source_of.count(s.scale_tensor)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", s.name, ": its scale_tensor ", s.scale_tensor,
                       " is a source tensor of model ", model, "; scales come from quantization"));
    }
    auto [d_first, d_last] = dest_of.equal_range(s.scale_tensor);
    for (auto it = d_first; it != d_last; ++it) {
      RETURN_IF_ERROR(plan::CheckScaleSlice(s, *it->second));
    }
    if (d_first == d_last && named.count(s.scale_tensor) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", s.name, ": scale_tensor ", s.scale_tensor, " is not registered for model ",
          model, " (register its DESTINATION slices in this buffer or an earlier one)"));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<const QuantBatch> Store::QuantBatchFor(
    Model& model, const std::string& layout_key,
    const std::vector<const std::vector<TensorSlice>*>& pieces) {
  // Kept among the plans (under a name no plan key has), so that whatever drops the plans (a
  // registration, another source layout) drops it too.
  const std::string key = absl::StrCat(std::string("\0quant|", 7), layout_key);
  auto it = model.plans.find(key);
  if (it != model.plans.end()) return it->second->batch;
  std::vector<const TensorSlice*> slices;
  for (const std::string& id : model.destinations) {
    for (const TensorSlice& s : buffers_.at(id)->slices) slices.push_back(&s);
  }
  auto cached = std::make_shared<CachedPlan>();
  cached->batch = QuantBatch::Make(slices, pieces);
  model.plans[key] = cached;
  return cached->batch;
}

absl::StatusOr<std::shared_ptr<Region>> Store::RunQuantBatch(
    const Version& version, const std::shared_ptr<const QuantBatch>& batch, bool partial) {
  std::vector<QuantSource> sources;
  for (const Piece& piece : version.pieces) {
    QuantSource source;
    source.slices = piece.slices.get();
    if (piece.slot && piece.slot->kind() == MemoryKind::kHost) {
      source.data = piece.slot->data();
    } else if (piece.host) {
      source.data = piece.host->data();  // a GPU slot's host mirror holds the same bytes
    }
    sources.push_back(source);
  }
  const auto started = Clock::now();
  uint64_t nonfinite = 0;
  uint64_t values = 0;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  auto slot = version.quant->Run(batch, sources, *pool_, threads, partial, &nonfinite, &values);
  if (values > 0) {
    metrics_->Add(kQuantizedValues, static_cast<double>(values));
    metrics_->Add(kNonfiniteValues, static_cast<double>(nonfinite));
    metrics_->Observe(kQuantizeSeconds,
                      std::chrono::duration<double>(Clock::now() - started).count());
  }
  return slot;
}

absl::StatusOr<std::vector<std::shared_ptr<Region>>> Store::QuantizedSlots(const Version& version,
                                                                           const CachedPlan& plan) {
  std::vector<std::shared_ptr<Region>> out;
  if (plan.jobs.empty()) return out;
  ASSIGN_OR_RETURN(std::shared_ptr<Region> slot, RunQuantBatch(version, plan.batch, false));
  out.push_back(std::move(slot));
  return out;
}

void Store::QuantizeEarly(Model& model, uint64_t number) {
  if (model.scale_tensors.empty() || model.HasRemoteSources()) return;
  auto pending = model.pending.find(number);
  if (pending == model.pending.end()) return;
  std::vector<std::string> ids;
  auto version = std::make_shared<Version>();  // the pieces here so far, in the version's order
  version->number = number;
  size_t here = 0;
  for (const std::string& id : model.sources) {  // sorted, as CompleteVersion sorts the pieces
    ids.push_back("/" + id);
    auto it = pending->second.find(id);
    Piece piece;
    if (it != pending->second.end()) {
      piece = it->second;
      ++here;
    } else {
      piece.buffer_id = id;
      piece.slices = buffers_.at(id)->snapshot_slices;
    }
    version->pieces.push_back(std::move(piece));
  }
  // All here: the version completes now and the quantizer finishes it; none: nothing to do.
  if (here == 0 || here == model.sources.size()) return;
  version->layout_key = absl::StrJoin(ids, ",");
  std::shared_ptr<QuantCache>& early = model.early_quant[number];
  if (!early) early = std::make_shared<QuantCache>();
  version->quant = early;
  quant_early_.emplace_back(model.name, std::move(version));
  if (!quantizer_.joinable()) quantizer_ = std::thread([this] { RunQuantizer(); });
  quant_wake_.NotifyOne();
}

void Store::RunQuantizer() {
  common::UniqueLock lock(mu_);
  while (true) {
    quant_wake_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || !quant_queue_.empty() || !quant_early_.empty();
    });
    if (shutdown_) return;
    if (quant_queue_.empty()) {
      // Part of a version still arriving: quantize what its published pieces hold.
      auto [name, version] = std::move(quant_early_.front());
      quant_early_.pop_front();
      Model* model = FindModel(name);
      if (!model || !model->pending.count(version->number) ||
          !model->early_quant.count(version->number)) {
        continue;  // completed, overtaken or dropped meanwhile
      }
      std::vector<const std::vector<TensorSlice>*> layout;
      for (const Piece& piece : version->pieces) layout.push_back(piece.slices.get());
      auto batch = QuantBatchFor(*model, version->layout_key, layout);
      lock.unlock();
      auto partial = RunQuantBatch(*version, batch, true);
      if (!partial.ok()) {
        Logger("store")->debug("model={} version={}: quantizing published pieces early: {}", name,
                               version->number, partial.status().ToString());
      }
      lock.lock();
      continue;
    }
    auto [name, version] = std::move(quant_queue_.front());
    quant_queue_.pop_front();
    Model* model = FindModel(name);
    if (!model || model->finishing != version->number) continue;
    std::vector<const std::vector<TensorSlice>*> layout;
    for (const Piece& piece : version->pieces) layout.push_back(piece.slices.get());
    auto batch = QuantBatchFor(*model, version->layout_key, layout);
    lock.unlock();
    const auto started = Clock::now();
    auto slots = RunQuantBatch(*version, batch, false);
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    lock.lock();
    model = FindModel(name);
    if (!model || model->finishing != version->number || model->run != version->run) continue;
    model->finishing = 0;
    if (!slots.ok()) {
      Logger("store")->error("model={} version={} abandoned: quantizing for fp8 destinations: {}",
                             name, version->number, slots.status().ToString());
      model->failed = version->number;
      model->failed_status = slots.status();
      changed_.NotifyAll();
    } else {
      const uint64_t nonfinite = version->quant->nonfinite();
      auto log = Logger("store");
      if (nonfinite > 0) {
        log->warn(
            "model={} version={} holds {} inf/NaN values: their blocks' fp8 scales are "
            "inf or NaN",
            name, version->number, nonfinite);
      }
      log->info("model={} version={} quantized {} fp8 boxes in {:.3f} s", name, version->number,
                batch->jobs().size(), seconds);
      PublishVersion(*model, version);
    }
    TryComplete(*model);
  }
}

}  // namespace refit
