#include "daemon/config/cli.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace refit::config {
namespace {

// A CLI11 check that runs the table's own parser on a scratch copy: the same rules (and
// messages) as the config file.
CLI::Validator TableCheck(const OptionSpec* spec) {
  return CLI::Validator(
      [spec](std::string& text) -> std::string {
        DaemonOptions scratch;
        absl::Status status = SetFromText(*spec, text, &scratch);
        return status.ok() ? std::string() : std::string(status.message());
      },
      "", "");
}

}  // namespace

CommandLine::CommandLine(CLI::App* app) {
  for (const OptionSpec& spec : OptionTable()) {
    auto flag = std::make_unique<Flag>();
    flag->spec = &spec;
    const std::string help =
        absl::StrCat(absl::StrReplaceAll(Describe(spec), {{"`", ""}}),
                     " [default: ", absl::StrReplaceAll(DefaultText(spec), {{"`", ""}}), "]");
    const std::string name = absl::StrCat("--", spec.flag);
    // Booleans are flags: bare means true, `--relay=false` sets false.
    flag->option = std::holds_alternative<bool DaemonOptions::*>(spec.field)
                       ? app->add_flag(name, flag->text, help)
                       : app->add_option(name, flag->text, help);
    flag->option->type_name(std::string(spec.value_name))->check(TableCheck(&spec));
    flags_.push_back(std::move(flag));
  }
}

void CommandLine::ApplyGiven(DaemonOptions* options) const {
  for (const auto& flag : flags_) {
    if (flag->option->count() == 0) continue;
    // Checked by TableCheck during parsing, so this cannot fail.
    (void)SetFromText(*flag->spec, flag->text, options);
  }
}

}  // namespace refit::config
