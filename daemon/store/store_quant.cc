// The store's side of fp8 destinations with block scales: RegisterBuffer's layout checks, the
// quantizer thread that quantizes a version before it completes, and the derived slots Apply
// copies from (quantize.h).
#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
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

absl::StatusOr<std::vector<std::shared_ptr<Region>>> Store::QuantizedSlots(
    const Version& version, const std::vector<QuantJob>& jobs) {
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
  auto slots = version.quant->Slots(sources, jobs, *pool_, threads, &nonfinite, &values);
  if (values > 0) {
    metrics_->Add(kQuantizedValues, static_cast<double>(values));
    metrics_->Add(kNonfiniteValues, static_cast<double>(nonfinite));
    metrics_->Observe(kQuantizeSeconds,
                      std::chrono::duration<double>(Clock::now() - started).count());
  }
  return slots;
}

void Store::RunQuantizer() {
  common::UniqueLock lock(mu_);
  while (true) {
    quant_wake_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutdown_ || !quant_queue_.empty(); });
    if (shutdown_) return;
    auto [name, version] = std::move(quant_queue_.front());
    quant_queue_.pop_front();
    Model* model = FindModel(name);
    if (!model || model->finishing != version->number) continue;
    std::vector<std::shared_ptr<Buffer>> dests;  // keeps the slices below alive
    std::vector<const TensorSlice*> slices;
    for (const std::string& id : model->destinations) {
      dests.push_back(buffers_.at(id));
      for (const TensorSlice& s : dests.back()->slices) slices.push_back(&s);
    }
    const std::vector<QuantJob> jobs = QuantJobsFor(slices);
    lock.unlock();
    const auto started = Clock::now();
    auto slots = QuantizedSlots(*version, jobs);
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    lock.lock();
    model = FindModel(name);
    if (!model || model->finishing != version->number) continue;
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
                jobs.size(), seconds);
      PublishVersion(*model, version);
    }
    TryComplete(*model);
  }
}

}  // namespace refit
