#include "daemon/config/config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/config/option_table.h"
#include "toml++/toml.h"

namespace refit {
namespace {

absl::Status Bad(const std::string& origin, const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": key '", key, "' ", what));
}

// The TOML value as the text a flag would carry, after checking its TOML type; the table's
// parser then applies the same rules to both.
absl::Status SetFromToml(const config::OptionSpec& spec, const toml::node& node,
                         DaemonOptions* options) {
  const absl::Status wrong_type = absl::InvalidArgumentError(config::Expectation(spec));
  // Arrays (of strings or integers) as a comma-separated list.
  auto join = [&](bool strings, std::string* out) {
    const toml::array* array = node.as_array();
    if (!array) return false;
    std::vector<std::string> items;
    for (const toml::node& item : *array) {
      if (strings && item.is_string() &&
          item.value<std::string>()->find(',') == std::string::npos) {
        items.push_back(*item.value<std::string>());
      } else if (!strings && item.is_integer()) {
        items.push_back(std::to_string(*item.value<int64_t>()));
      } else {
        return false;
      }
    }
    *out = absl::StrJoin(items, ",");
    return true;
  };
  return std::visit(
      [&](auto field) -> absl::Status {
        using T = std::remove_reference_t<decltype(options->*field)>;
        std::string text;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) return wrong_type;
          text = *node.value<std::string>();
          if (text.empty() && spec.empty_keeps_default) return absl::OkStatus();
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) return wrong_type;
          text = *node.value<bool>() ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          if (!node.is_floating_point() && !node.is_integer()) return wrong_type;
          text = absl::StrFormat("%.17g", *node.value<double>());
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (node.is_string()) {
            text = *node.value<std::string>();
          } else if (!join(true, &text)) {
            return wrong_type;
          }
        } else if constexpr (std::is_same_v<T, std::vector<uint32_t>>) {
          if (!join(false, &text)) return wrong_type;
        } else if (node.is_integer()) {
          if (*node.value<int64_t>() < 0) return wrong_type;
          text = std::to_string(*node.value<int64_t>());
        } else if (spec.size && node.is_string()) {
          text = *node.value<std::string>();
        } else {
          return wrong_type;
        }
        return config::SetFromText(spec, text, options);
      },
      spec.field);
}

std::string KnownKeys() {
  std::vector<std::string> keys;
  for (const config::OptionSpec& spec : config::OptionTable()) keys.push_back(spec.Key());
  return absl::StrJoin(keys, ", ");
}

}  // namespace

absl::Status ParseConfig(const std::string& text, const std::string& origin,
                         DaemonOptions* options) {
  toml::table table;
  try {
    table = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid TOML at ", where.str(),
                                                   ": ", std::string(e.description())));
  }
  DaemonOptions parsed = *options;
  for (const auto& [key_view, node] : table) {
    const std::string key(key_view.str());
    const config::OptionSpec* spec = config::FindByKey(key);
    if (spec == nullptr)
      return Bad(origin, key, absl::StrCat("is unknown (known: ", KnownKeys(), ")"));
    absl::Status status = SetFromToml(*spec, node, &parsed);
    if (!status.ok()) return Bad(origin, key, std::string(status.message()));
  }
  *options = std::move(parsed);
  return absl::OkStatus();
}

absl::Status LoadConfigFile(const std::string& path, DaemonOptions* options) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), path, options);
}

}  // namespace refit
