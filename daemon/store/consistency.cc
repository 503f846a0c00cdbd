// Store: do a model's buffers agree on its tensors? The model's tensors are what its SOURCE
// slices describe, on this node and on the others: a source that disagrees with another source
// is refused when it registers, and so is a destination that disagrees with the sources. A
// destination that registered before any source it disagrees with (an engine that came first
// with a wrong shape) does not make the trainer's registration fail: the sources win, and that
// destination is marked refused (Status shows why; Apply naming it is FAILED_PRECONDITION; no
// plan includes it) until it is released and registered again with the sources' layout.

#include <map>
#include <string_view>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/convert.h"
#include "daemon/plan/scales.h"
#include "daemon/store/store.h"
#include "daemon/store/store_internal.h"

namespace refit {
namespace {

// A slice already registered for the model, with who registered it (for messages, spelled out
// only when one is written: 100,000 slices make no 100,000 strings).
struct Registered {
  const TensorSlice* slice = nullptr;
  const std::string* id = nullptr;
  const std::string* client = nullptr;  // null: a SOURCE buffer on node `*node`
  const std::string* node = nullptr;
  // e.g. "SOURCE buffer n1/llama/src-1 (client trainer-rank0)"
  std::string Who() const {
    if (client) {
      return absl::StrCat("SOURCE buffer ", *id, " (client ", client->empty() ? "unnamed" : *client,
                          ")");
    }
    return absl::StrCat("SOURCE buffer ", *id, " on node ", *node);
  }
};

// Tensors by name, the names pointing into the slices (which outlive the map).
template <typename T>
using ByName = std::unordered_map<std::string_view, T>;

// The tensors of SourcesOf held by SOURCE buffers on this node.
class LocalSources : public ScaleMaps::SourceNames {
 public:
  explicit LocalSources(const ByName<Registered>& sources) : sources_(sources) {}
  bool Has(std::string_view name) const override {
    auto it = sources_.find(name);
    return it != sources_.end() && it->second.client != nullptr;
  }

 private:
  const ByName<Registered>& sources_;
};

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// `slice` (a destination's) against the source slice of the same tensor: empty when they
// agree.
std::string DestinationConflict(const TensorSlice& slice, const Registered& source) {
  if (source.slice->global_shape != slice.global_shape) {
    return absl::StrCat("tensor ", slice.name, ": global_shape ", Shape(slice.global_shape),
                        " disagrees with ", Shape(source.slice->global_shape), " of ",
                        source.Who());
  }
  absl::Status convertible = plan::CheckConvertible(source.slice->dtype, slice.dtype);
  if (!convertible.ok()) {
    return absl::StrCat("tensor ", slice.name, ": ", convertible.message(), " (the source is ",
                        source.Who(), ")");
  }
  return "";
}

// Every SOURCE slice of `model` by tensor name, here and on other nodes (the first one seen).
template <typename Buffers>
ByName<Registered> SourcesOf(const Buffers& buffers, const std::set<std::string>& local,
                             const std::map<std::string, std::vector<SourceLayout>>& remote) {
  ByName<Registered> out;
  for (const std::string& id : local) {
    const auto& buffer = *buffers.at(id);
    for (const TensorSlice& s : buffer.slices) {
      out.emplace(s.name, Registered{&s, &buffer.id, &buffer.client, nullptr});
    }
  }
  for (const auto& [node, layouts] : remote) {
    for (const SourceLayout& layout : layouts) {
      for (const TensorSlice& s : *layout.slices) {
        out.emplace(s.name, Registered{&s, &layout.buffer_id, nullptr, &node});
      }
    }
  }
  return out;
}

}  // namespace

absl::Status Store::CheckAgainstModel(const Model& model, Role role,
                                      const std::vector<TensorSlice>& slices) const {
  std::map<std::string, std::vector<SourceLayout>> remote;
  for (const auto& [node, r] : model.remotes) {
    if (!r.sources.empty()) remote[node] = r.sources;
  }
  ByName<Registered> sources = SourcesOf(buffers_, model.sources, remote);
  ByName<const TensorSlice*> request;  // this request's slices, by tensor (the first of each)
  request.reserve(slices.size());
  for (const TensorSlice& s : slices) {
    auto [mine, first] = request.emplace(s.name, &s);
    if (!first &&
        (mine->second->global_shape != s.global_shape || mine->second->dtype != s.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", s.name, ": two slices of this request disagree (global_shape ",
                       Shape(mine->second->global_shape), " ", DTypeName(mine->second->dtype),
                       " and ", Shape(s.global_shape), " ", DTypeName(s.dtype), ")"));
    }
  }
  bool scaled = !model.scale_tensors.empty();
  for (size_t i = 0; i < slices.size() && !scaled; ++i) scaled = plan::IsScaled(slices[i]);
  std::vector<char> is_scale;  // per slice: of a scale tensor (CheckScaleLayout)
  if (scaled) {
    // fp8 destinations with block scales: their scale tensors, shapes and blocks
    // (CheckScaleLayout, store_quant.cc). Nothing to check where neither the model nor the
    // request has any.
    ScaleMaps::ByNameMulti dest_of;
    ScaleMaps::ByNameMulti scaled_by;  // scale tensor -> fp8 slices
    for (const std::string& id : model.destinations) {
      for (const TensorSlice& s : buffers_.at(id)->slices) {
        if (role == Role::kDestination) dest_of.emplace(s.name, &s);
        if (plan::IsScaled(s)) scaled_by.emplace(s.scale_tensor, &s);
      }
    }
    RETURN_IF_ERROR(CheckScaleLayout(model.name, role, slices, LocalSources(sources), dest_of,
                                     scaled_by, &is_scale));
  }
  // A scale tensor's slices were checked above and no local SOURCE slice has its name (scales
  // come from quantization): without other nodes' sources there is nothing to look up for them.
  const bool skip_scales = role == Role::kDestination && remote.empty() && !is_scale.empty();
  for (size_t i = 0; i < slices.size(); ++i) {
    if (skip_scales && is_scale[i]) continue;
    const TensorSlice& s = slices[i];
    auto src = sources.find(s.name);
    if (role == Role::kDestination) {
      if (src == sources.end()) continue;  // no source of it yet: checked when one comes
      const std::string conflict = DestinationConflict(s, src->second);
      if (!conflict.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            conflict, " of model ", model.name,
            "; a model's tensors are what its SOURCE buffers say: register this destination "
            "with that shape (and a dtype it converts to)"));
      }
      continue;
    }
    if (src != sources.end()) {
      const TensorSlice& other = *src->second.slice;
      if (other.global_shape != s.global_shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", s.name, ": global_shape ", Shape(s.global_shape), " disagrees with ",
            Shape(other.global_shape), " of ", src->second.Who(), ", registered first for model ",
            model.name, "; every SOURCE slice of a tensor names the whole tensor's shape"));
      }
      if (other.dtype != s.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", s.name, ": dtype ", DTypeName(s.dtype), " disagrees with ",
            DTypeName(other.dtype), " of ", src->second.Who(), ", registered first for model ",
            model.name, "; every SOURCE slice of a tensor has the same dtype"));
      }
      continue;
    }
  }
  return absl::OkStatus();
}

void Store::RecheckDestinations(Model& model) {
  std::map<std::string, std::vector<SourceLayout>> remote;
  for (const auto& [node, r] : model.remotes) {
    if (!r.sources.empty()) remote[node] = r.sources;
  }
  const ByName<Registered> sources = SourcesOf(buffers_, model.sources, remote);
  bool changed = false;
  for (const std::string& id : model.destinations) {
    Buffer& buffer = *buffers_.at(id);
    std::string conflict;
    for (const TensorSlice& s : buffer.slices) {
      auto src = sources.find(s.name);
      if (src == sources.end()) continue;
      conflict = DestinationConflict(s, src->second);
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
