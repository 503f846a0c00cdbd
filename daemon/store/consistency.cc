// Store: do a model's buffers agree on its tensors? The model's tensors are what its SOURCE
// slices describe, on this node and on the others: a source that disagrees with another source
// is refused when it registers, and so is a destination that disagrees with the sources. A
// destination that registered before any source it disagrees with (an engine that came first
// with a wrong shape) does not make the trainer's registration fail: the sources win, and that
// destination is marked refused (Status shows why; Apply naming it is FAILED_PRECONDITION; no
// plan includes it) until it is released and registered again with the sources' layout.

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/dtype_convert.h"
#include "daemon/plan/scales.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// `slice` (a destination's) against the source slice of the same tensor: empty when they
// agree.
std::string DestinationConflict(const TensorSlice& slice, const SourceRef& source) {
  if (source.slice->global_shape != slice.global_shape) {
    return absl::StrCat("tensor ", slice.name, ": global_shape ", Shape(slice.global_shape),
                        " disagrees with ", Shape(source.slice->global_shape), " of ",
                        source.Who());
  }
  if (source.slice->dtype != slice.dtype) {  // the same dtype always converts
    absl::Status convertible = plan::CheckConvertible(source.slice->dtype, slice.dtype);
    if (!convertible.ok()) {
      return absl::StrCat("tensor ", slice.name, ": ", convertible.message(), " (the source is ",
                          source.Who(), ")");
    }
  }
  return "";
}

// How many names ahead a loop over a request prefetches table slots.
constexpr size_t kAhead = 8;

}  // namespace

const SourceIndex& Store::SourcesOf(const Model& model) const {
  SourceIndex& index = model.source_index;
  // Other nodes' layouts: the same slices (by address, held alive by the index) in the same
  // order, or the index is rebuilt.
  bool same = index.valid();
  size_t at = 0;
  const auto& remote = index.remote();
  const RemoteView::Nodes remotes = remotes_.Of(model.name);
  for (auto it = remotes.begin(); same && it != remotes.end(); ++it) {
    for (const SourceLayout& layout : it->second.sources) {
      same = same && at < remote.size() && remote[at] == layout.slices;
      ++at;
    }
  }
  if (same && at == remote.size()) return index;
  index.Clear();
  for (const std::string& id : model.sources) {
    const Buffer& buffer = *buffers_.at(id);
    index.AddLocal(buffer.id, buffer.client, buffer.slices);
  }
  for (const auto& [node, r] : remotes) {
    for (const SourceLayout& layout : r.sources)
      index.AddRemote(node, layout.buffer_id, layout.slices);
  }
  index.set_valid();
  return index;
}

const DestinationIndex& Store::DestinationsOf(const Model& model, bool slices, bool scaled) const {
  DestinationIndex& index = model.destination_index;
  if ((slices && !index.has_slices()) || (scaled && !index.has_scaled())) {
    std::vector<const std::vector<TensorSlice>*> buffers;
    for (const std::string& id : model.destinations) buffers.push_back(&buffers_.at(id)->slices);
    if (slices) index.BuildSlices(buffers);
    if (scaled) index.BuildScaled(buffers);
  }
  return index;
}

absl::Status Store::CheckAgainstModel(const Model& model, Role role,
                                      const std::vector<TensorSlice>& slices) const {
  const SourceIndex& sources = SourcesOf(model);
  // Each name hashed once, for the request's table and the sources'; both tables are bigger
  // than the caches for 100,000 tensors, so each loop asks for the slots a few names ahead.
  const size_t n = slices.size();
  std::vector<uint64_t> hashes(n);
  for (size_t i = 0; i < n; ++i) hashes[i] = NameTable::Hash(slices[i].name);
  // This request's slices by tensor (the first of each), and each slice's first.
  NameTable request;
  request.Reserve(n);
  std::vector<uint32_t> first_of(n);
  bool scaled = model.HasScales();
  for (uint32_t i = 0; i < n; ++i) {
    const TensorSlice& s = slices[i];
    if (i + kAhead < n) request.Prefetch(hashes[i + kAhead]);
    const uint32_t first = request.Insert(s.name, hashes[i], i);
    first_of[i] = first;
    scaled = scaled || plan::IsScaled(s);
    if (first != i &&
        (slices[first].global_shape != s.global_shape || slices[first].dtype != s.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", s.name, ": two slices of this request disagree (global_shape ",
                       Shape(slices[first].global_shape), " ", DTypeName(slices[first].dtype),
                       " and ", Shape(s.global_shape), " ", DTypeName(s.dtype), ")"));
    }
  }
  std::vector<char> is_scale;  // per slice: of a scale tensor (CheckScaleLayout)
  if (scaled) {
    // fp8 destinations with block scales: their scale tensors, shapes and blocks
    // (CheckScaleLayout, store_quant.cc). Nothing to check where neither the model nor the
    // request has any. What was registered before is looked up only where there is some.
    const DestinationIndex* before = nullptr;
    if (!model.destinations.empty()) {
      before = &DestinationsOf(model, role == Role::kDestination, true);
    }
    RETURN_IF_ERROR(
        CheckScaleLayout(model.name, role, slices, request, first_of, sources, before, &is_scale));
  }
  // A scale tensor's slices were checked above and no local SOURCE slice has its name (scales
  // come from quantization): without other nodes' sources there is nothing to look up for them.
  const bool skip_scales =
      role == Role::kDestination && sources.remote().empty() && !is_scale.empty();
  const NameTable& by_name = sources.by_name();
  for (size_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) by_name.Prefetch(hashes[i + 2 * kAhead]);
    if (i + kAhead < n) by_name.PrefetchName(hashes[i + kAhead]);
    if (skip_scales && is_scale[i]) continue;
    const TensorSlice& s = slices[i];
    const SourceRef* src = sources.Find(s.name, hashes[i]);
    if (!src) continue;  // a destination with no source of it yet: checked when one comes
    if (role == Role::kDestination) {
      const std::string conflict = DestinationConflict(s, *src);
      if (!conflict.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            conflict, " of model ", model.name,
            "; a model's tensors are what its SOURCE buffers say: register this destination "
            "with that shape (and a dtype it converts to)"));
      }
      continue;
    }
    const TensorSlice& other = *src->slice;
    if (other.global_shape != s.global_shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", s.name, ": global_shape ", Shape(s.global_shape), " disagrees with ",
          Shape(other.global_shape), " of ", src->Who(), ", registered first for model ",
          model.name, "; every SOURCE slice of a tensor names the whole tensor's shape"));
    }
    if (other.dtype != s.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", s.name, ": dtype ", DTypeName(s.dtype), " disagrees with ",
                       DTypeName(other.dtype), " of ", src->Who(), ", registered first for model ",
                       model.name, "; every SOURCE slice of a tensor has the same dtype"));
    }
  }
  return absl::OkStatus();
}

void Store::RecheckDestinations(Model& model) {
  if (model.destinations.empty()) return;
  const SourceIndex& sources = SourcesOf(model);
  bool changed = false;
  for (const std::string& id : model.destinations) {
    Buffer& buffer = *buffers_.at(id);
    std::string conflict;
    for (const TensorSlice& s : buffer.slices) {
      const SourceRef* src = sources.Find(s.name);
      if (!src) continue;
      conflict = DestinationConflict(s, *src);
      if (!conflict.empty()) break;
    }
    if (conflict == buffer.refused) continue;
    changed = true;
    if (conflict.empty()) {
      Logger("store")->info("model={} buffer={} agrees with the model's sources again", model.name,
                            id);
    } else {
      conflict = absl::StrCat(
          "DESTINATION buffer ", id, " (client ", buffer.client.empty() ? "unnamed" : buffer.client,
          ") of model ", model.name, " is refused: ", conflict,
          ", which registered after it; the sources' layout wins: release this buffer and "
          "register it with that layout");
      Logger("store")->warn("model={} buffer={} {}", model.name, id, conflict);
    }
    buffer.refused = std::move(conflict);
  }
  if (changed) model.plans.clear();
}

}  // namespace refit
