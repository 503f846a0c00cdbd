// The store's side of fp8 destinations with block scales: RegisterBuffer's layout checks, the
// quantizer thread that quantizes a version before it completes (partly while its local pieces
// are still being published), and the derived slot Apply copies from (quantize.h).
#include <algorithm>
#include <deque>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/scales.h"
#include "daemon/store/store_internal.h"

namespace refit {

namespace {

// The index of the first slice of `name` in the request: a neighbour of `i` where it is one
// (an engine registers a weight beside its scales: a string compare, not a hash lookup), else
// looked up; NameTable::kNone where the request has none.
uint32_t FirstInRequest(const std::vector<TensorSlice>& slices, const NameTable& request,
                        const std::vector<uint32_t>& first_of, size_t i, const std::string& name) {
  if (i + 1 < slices.size() && slices[i + 1].name == name) return first_of[i + 1];
  if (i > 0 && slices[i - 1].name == name) return first_of[i - 1];
  return request.Find(name);
}

}  // namespace

absl::Status CheckScaleLayout(const std::string& model, Role role,
                              const std::vector<TensorSlice>& slices, const NameTable& request,
                              const std::vector<uint32_t>& first_of, const SourceIndex& sources,
                              const DestinationIndex* destinations, std::vector<char>* is_scale) {
  const NameChains* scaled_before =
      destinations && !destinations->scaled().empty() ? &destinations->scaled() : nullptr;
  if (role == Role::kSource) {
    if (!scaled_before) return absl::OkStatus();
    for (const TensorSlice& s : slices) {
      const TensorSlice* scaled = nullptr;
      scaled_before->ForEach(s.name, [&](const TensorSlice& fp8) {
        scaled = &fp8;
        return false;
      });
      if (scaled) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", s.name, " is the scale tensor of ", scaled->name, " in model ",
                         model, ": its scales come from quantization, never from a source"));
      }
    }
    return absl::OkStatus();
  }
  // Each scaled slice against its scale tensor's slices: the request's first slice of it (the
  // request's other slices of a tensor have its dtype and global_shape, checked before) and
  // those registered before. `scale_first[j]`: slice j is the first of a scale tensor.
  std::vector<char> scale_first(slices.size(), 0);
  const NameChains* destinations_before =
      destinations && !destinations->slices().empty() ? &destinations->slices() : nullptr;
  for (size_t i = 0; i < slices.size(); ++i) {
    const TensorSlice& s = slices[i];
    if (!plan::IsScaled(s)) continue;
    const SourceRef* source = sources.Find(s.scale_tensor);
    if (source && source->client) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", s.name, ": its scale_tensor ", s.scale_tensor,
                       " is a source tensor of model ", model, "; scales come from quantization"));
    }
    const uint32_t first = FirstInRequest(slices, request, first_of, i, s.scale_tensor);
    if (first != NameTable::kNone) {
      RETURN_IF_ERROR(plan::CheckScaleSlice(s, slices[first]));
      scale_first[first] = 1;
    }
    size_t before = 0;
    if (destinations_before) {
      absl::Status checked;
      before = destinations_before->ForEach(s.scale_tensor, [&](const TensorSlice& scale) {
        checked = plan::CheckScaleSlice(s, scale);
        return checked.ok();
      });
      RETURN_IF_ERROR(checked);
    }
    if (first == NameTable::kNone && before == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", s.name, ": scale_tensor ", s.scale_tensor, " is not registered for model ",
          model, " (register its DESTINATION slices in this buffer or an earlier one)"));
    }
  }
  // Each slice of a scale tensor: named by a scaled slice of the request (checked above), or
  // by fp8 slices registered before (checked here).
  is_scale->assign(slices.size(), 0);
  for (size_t i = 0; i < slices.size(); ++i) {
    (*is_scale)[i] = scale_first[first_of[i]];
    if (!scaled_before) continue;
    const TensorSlice& s = slices[i];
    absl::Status checked;
    const size_t named = scaled_before->ForEach(s.name, [&](const TensorSlice& fp8) {
      checked = plan::CheckScaleSlice(fp8, s);
      return checked.ok();
    });
    RETURN_IF_ERROR(checked);
    if (named > 0) (*is_scale)[i] = 1;
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

absl::StatusOr<std::pair<plan::Plan, plan::Plan>> Store::QuantPlans(
    const Model& model, const Version& version, const std::vector<plan::PlacedSlice>& sources,
    const std::vector<plan::PlacedSlice>& destinations, const CachedPlan& cached,
    const plan::PlanOptions& options) {
  // Scaled fp8 slices and the scale tensors come from the derived slot (location `slot`): each
  // scaled slice from its job's fp8 bytes, paired one for one (no name lookups), and each slice
  // of a scale tensor from the job whose scales hold it, where one does. What is left (plain
  // destinations, scale slices spread over several jobs) is planned by name, the derived
  // slices renamed so that only those can fill them.
  const uint32_t slot = static_cast<uint32_t>(version.pieces.size());
  const DestinationIndex& scale_tensors = DestinationsOf(model, false, true);
  std::unordered_map<std::string_view, std::vector<const QuantJob*>> jobs_of_scale;
  for (const QuantJob* job : cached.jobs) {
    jobs_of_scale[std::string_view(job->scales.name).substr(3)].push_back(job);  // ScalePlanName
  }
  std::vector<plan::SlicePair> derived_pairs;
  std::vector<plan::SlicePair> read_pairs;
  std::deque<TensorSlice> renamed;  // stable addresses
  std::vector<plan::PlacedSlice> derived_rest;
  std::vector<plan::PlacedSlice> read_rest;
  std::unordered_set<std::string_view> rest_names;  // of derived_rest and read_rest
  bool rest_scales = false;  // derived_rest holds scale slices: all jobs' scales are sources
  for (const plan::PlacedSlice& d : destinations) {
    const TensorSlice& slice = *d.slice;
    if (plan::IsScaled(slice)) {
      const QuantJob* job = cached.batch->JobOf(&slice);
      if (!job) return absl::InternalError(absl::StrCat("no quantization of ", slice.name));
      derived_pairs.push_back({{&job->fp8, slot, 0}, d});
      // What Apply needs held of the sources: the job's one source slice, or a plan's choice.
      const TensorSlice* only = nullptr;
      if (job->only_piece < version.pieces.size()) {
        const std::vector<TensorSlice>& held = *version.pieces[job->only_piece].slices;
        if (job->only_index < held.size() && held[job->only_index].name == slice.name) {
          only = &held[job->only_index];
        }
      }
      if (only) {
        read_pairs.push_back({{only, job->only_piece, 0}, d});
      } else {
        read_rest.push_back(d);
        rest_names.insert(slice.name);
      }
      continue;
    }
    if (scale_tensors.IsScaleTensor(slice.name)) {
      const QuantJob* holder = nullptr;
      auto jobs = jobs_of_scale.find(slice.name);
      if (jobs != jobs_of_scale.end()) {
        for (const QuantJob* job : jobs->second) {
          bool holds = true;
          for (size_t k = 0; holds && k < slice.offsets.size(); ++k) {
            holds =
                k < job->scales.offsets.size() && job->scales.offsets[k] <= slice.offsets[k] &&
                slice.offsets[k] + slice.sizes[k] <= job->scales.offsets[k] + job->scales.sizes[k];
          }
          if (holds && job->scales.offsets.size() == slice.offsets.size()) {
            holder = job;
            break;
          }
        }
      }
      if (holder) {
        derived_pairs.push_back({{&holder->scales, slot, 0}, d});
      } else {
        renamed.push_back(slice);
        renamed.back().name = ScalePlanName(slice.name);
        derived_rest.push_back({&renamed.back(), d.location, d.node});
        rest_names.insert(renamed.back().name);
        rest_scales = true;
      }
      continue;
    }
    derived_rest.push_back(d);
    read_rest.push_back(d);
    rest_names.insert(slice.name);
  }
  // The sources the rest is planned from: those of its tensors only.
  std::vector<plan::PlacedSlice> rest_sources;
  if (!rest_names.empty()) {
    for (const plan::PlacedSlice& s : sources) {
      if (rest_names.count(s.slice->name)) rest_sources.push_back(s);
    }
  }
  std::vector<plan::PlacedSlice> derived_sources = rest_sources;
  if (rest_scales) {
    for (const QuantJob* job : cached.jobs) derived_sources.push_back({&job->scales, slot, 0});
  }
  std::pair<plan::Plan, plan::Plan> out;
  ASSIGN_OR_RETURN(out.first,
                   plan::BuildPlan(derived_sources, derived_rest, options, derived_pairs));
  ASSIGN_OR_RETURN(out.second, plan::BuildPlan(rest_sources, read_rest, options, read_pairs));
  return out;
}

absl::StatusOr<std::shared_ptr<Region>> Store::RunQuantBatch(
    const Version& version, const std::shared_ptr<const QuantBatch>& batch, bool partial,
    const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>* landed, unsigned threads,
    size_t max_tasks, size_t* runnable_left) {
  // GPU slots (--slot-memory=cuda: every piece here published on this node into GPU memory of
  // one device) are quantized there, by the GPU kernel, into a GPU slot; everything else (host
  // slots, pulled pieces, a mix) on the CPU from host memory, a GPU slot's host mirror included.
  int device = QuantCache::kOnHost;
  if (budget_.gpu() && !landed) {
    bool on_device = false;
    for (const Piece& piece : version.pieces) {
      if (!piece.slot) continue;
      if (piece.slot->kind() != MemoryKind::kCuda ||
          (on_device && piece.slot->device() != device)) {
        on_device = false;
        break;
      }
      on_device = true;
      device = piece.slot->device();
    }
    if (!on_device) device = QuantCache::kOnHost;
  }
  std::vector<QuantSource> sources;
  for (size_t p = 0; p < version.pieces.size(); ++p) {
    const Piece& piece = version.pieces[p];
    QuantSource source;
    source.slices = piece.slices.get();
    if (landed && p < landed->size()) source.landed = &(*landed)[p];
    if (piece.slot && (device != QuantCache::kOnHost || piece.slot->kind() == MemoryKind::kHost)) {
      source.data = piece.slot->data();
      source.region = piece.slot.get();
    } else if (piece.host) {
      source.data = piece.host->data();  // a GPU slot's host mirror holds the same bytes
      source.region = piece.host.get();
    }
    sources.push_back(source);
  }
  const auto started = Clock::now();
  uint64_t nonfinite = 0;
  uint64_t values = 0;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  SlotPool& pool = device != QuantCache::kOnHost ? *budget_.gpu() : *budget_.host();
  auto slot = version.quant->Run(batch, sources, pool, threads, partial, &nonfinite, &values,
                                 device, max_tasks, runnable_left);
  if (values > 0) {
    counters_.quantized_values.Add(static_cast<double>(values));
    if (device != QuantCache::kOnHost) {
      counters_.quantized_gpu_values.Add(static_cast<double>(values));
    }
    counters_.nonfinite_values.Add(static_cast<double>(nonfinite));
    counters_.quantize_seconds.Observe(
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
  if (!model.HasScales() || HasRemoteSources(model)) return;
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
  quant_queue_.Push({model.name, std::move(version), /*early=*/true});
}

bool Store::QuantizesWhilePulling(const std::string& model_name) const {
  common::MutexLock lock(mu_);
  const Model* model = FindModel(model_name);
  return model && model->HasScales() && HasRemoteSources(*model);
}

bool Store::QuantizeLanded(const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
                           const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& landed,
                           const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& refetched,
                           size_t max_tasks) {
  auto version = std::make_shared<Version>();  // the pulled pieces, in the version's order
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> landed_by_piece;
  std::vector<size_t> fetch_of_piece;
  std::shared_ptr<const QuantBatch> batch;
  {
    common::MutexLock lock(mu_);
    Model* model = FindModel(job.model);
    if (!model || model->pulling != job.version || !model->HasScales()) return false;
    std::vector<Piece> pieces = model->pulling_pieces;
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
      return std::tie(a.node, a.buffer_id) < std::tie(b.node, b.buffer_id);
    });
    std::vector<std::string> ids;
    for (Piece& piece : pieces) {
      ids.push_back(piece.node + "/" + piece.buffer_id);
      landed_by_piece.emplace_back();
      fetch_of_piece.push_back(job.fetches.size());
      for (size_t f = 0; f < job.fetches.size() && f < staging.size(); ++f) {
        if (piece.node != job.fetches[f].node || piece.buffer_id != job.fetches[f].buffer_id) {
          continue;
        }
        fetch_of_piece.back() = f;
        if (staging[f] && staging[f]->kind() == MemoryKind::kHost && f < landed.size()) {
          piece.slot = staging[f];
          landed_by_piece.back() = landed[f];
        }
      }
    }
    version->number = job.version;
    version->pieces = std::move(pieces);
    version->layout_key = absl::StrJoin(ids, ",");
    std::vector<const std::vector<TensorSlice>*> layout;
    for (const Piece& piece : version->pieces) layout.push_back(piece.slices.get());
    batch = QuantBatchFor(*model, version->layout_key, layout);
    std::shared_ptr<QuantCache>& early = model->early_quant[job.version];
    if (!early) early = std::make_shared<QuantCache>();
    version->quant = early;
  }
  for (uint32_t p = 0; p < fetch_of_piece.size(); ++p) {
    const size_t f = fetch_of_piece[p];
    if (f < refetched.size() && !refetched[f].empty())
      version->quant->Forget(*batch, p, refetched[f]);
  }
  // One thread, a few tasks: the pull this overlaps is itself CPU-bound where the network is
  // fast (loopback, shared memory), and what is left when it ends runs on every core anyway.
  size_t left = 0;
  auto partial = RunQuantBatch(*version, batch, true, &landed_by_piece, 1, max_tasks, &left);
  if (!partial.ok()) {
    Logger("store")->debug("model={} version={}: quantizing landed bytes early: {}", job.model,
                           job.version, partial.status().ToString());
    return false;
  }
  return left > 0;
}

void Store::RunQuantJob(QuantQueue<Version>::Job job) {
  common::UniqueLock lock(mu_);
  if (shutdown_) return;
  const std::string& name = job.model;
  const std::shared_ptr<const Version>& version = job.version;
  if (job.early) {
    // Part of a version still arriving: quantize what its published pieces hold.
    Model* model = FindModel(name);
    if (!model || !model->pending.count(version->number) ||
        !model->early_quant.count(version->number)) {
      return;  // completed, overtaken or dropped meanwhile
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
    return;
  }
  Model* model = FindModel(name);
  if (!model || model->finishing != version->number) return;
  std::vector<const std::vector<TensorSlice>*> layout;
  for (const Piece& piece : version->pieces) layout.push_back(piece.slices.get());
  auto batch = QuantBatchFor(*model, version->layout_key, layout);
  // Engines on this node that hold the newest complete version: the derived slot diffed
  // against that version's, for a sparse Apply into fp8 destinations (store_sparse.cc).
  std::shared_ptr<const Version> diff_base = DiffBaseFor(*model);
  if (diff_base) {
    bool held = false;
    for (const std::string& id : model->destinations) {
      held = held || buffers_.at(id)->applied == diff_base->number;
    }
    if (!held || diff_base->layout_key != version->layout_key) diff_base.reset();
  }
  lock.unlock();
  const auto started = Clock::now();
  auto slots = RunQuantBatch(*version, batch, false);
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (slots.ok() && diff_base) DiffDerived(*version, *diff_base, batch);
  lock.lock();
  model = FindModel(name);
  if (!model || model->finishing != version->number || model->run != version->run) return;
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
    for (StoreEvents* listener : listeners_) {
      listener->OnVersionQuantized(name, version->number, seconds);
    }
    PublishVersion(*model, version);
  }
  TryComplete(*model);
}

}  // namespace refit
