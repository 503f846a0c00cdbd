// Prints refitd's flag reference (Markdown) from the option table, for docs/api.md
// (scripts/check/options-doc.sh); with --keys, one line per option: "KEY --FLAG TYPE" (TYPE:
// string, bool, integer, number, size, strings or ids), for the deployment tests (deploy/tests).
#include <cstring>
#include <iostream>
#include <variant>

#include "daemon/config/option_table.h"

namespace {

using refit::DaemonOptions;

std::string TypeName(const refit::config::OptionSpec& spec) {
  if (spec.size) return "size";
  return std::visit(
      [](auto field) -> std::string {
        using T = std::remove_reference_t<decltype(std::declval<DaemonOptions>().*field)>;
        if constexpr (std::is_same_v<T, std::string>) return "string";
        if constexpr (std::is_same_v<T, bool>) return "bool";
        if constexpr (std::is_same_v<T, double>) return "number";
        if constexpr (std::is_same_v<T, std::vector<std::string>>) return "strings";
        if constexpr (std::is_same_v<T, std::vector<uint32_t>>) return "ids";
        return "integer";
      },
      spec.field);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--keys") == 0) {
    for (const auto& spec : refit::config::OptionTable()) {
      std::cout << spec.Key() << " --" << spec.flag << " " << TypeName(spec) << "\n";
    }
    return 0;
  }
  std::cout << refit::config::RenderMarkdown();
  return 0;
}
