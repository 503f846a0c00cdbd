#include "daemon/store/delta_base_mode.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace refit {
namespace {

bool ParseMode(const std::string& text, DeltaBase* out) {
  if (text == "held") {
    *out = DeltaBase::kHeld;
  } else if (text == "destination") {
    *out = DeltaBase::kDestination;
  } else {
    return false;
  }
  return true;
}

}  // namespace

absl::Status ParseDeltaBase(const std::string& text, DeltaBase* default_base,
                            std::map<std::string, DeltaBase>* per_model) {
  DeltaBase fallback = DeltaBase::kHeld;
  bool have_default = false;
  std::map<std::string, DeltaBase> models;
  const auto bad = [&](const std::string& item, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--delta-base=", text, ": '", item, "' ", why,
                     " (expected held, destination, or MODEL=held|destination, comma-separated)"));
  };
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::string item(part);
    if (item.empty()) return bad(item, "is empty");
    const size_t eq = item.find('=');
    DeltaBase mode;
    if (eq == std::string::npos) {
      if (!ParseMode(item, &mode)) return bad(item, "is not a mode");
      if (have_default) return bad(item, "is a second mode for every model");
      have_default = true;
      fallback = mode;
      continue;
    }
    const std::string model = item.substr(0, eq);
    if (model.empty()) return bad(item, "names no model");
    if (!ParseMode(item.substr(eq + 1), &mode)) return bad(item, "has no mode held|destination");
    if (!models.emplace(model, mode).second) return bad(item, "names a model twice");
  }
  *default_base = fallback;
  *per_model = std::move(models);
  return absl::OkStatus();
}

const char* DeltaBaseName(DeltaBase base) {
  return base == DeltaBase::kDestination ? "destination" : "held";
}

}  // namespace refit
