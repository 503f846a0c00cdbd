#pragma once

// The one declaration of every refitd option: its flag, config-file key, type, range, default
// and help. The command line (cli.h), the config file (config.h), `refitd --help`, the
// config-file error for an unknown key and the flag reference in docs/api.md all come from
// OptionTable(); options_doc_test holds the docs to it.

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "daemon/options.h"

namespace refit::config {

// Where an option's value lands in DaemonOptions; its type is the option's type.
using OptionField =
    std::variant<std::string DaemonOptions::*, bool DaemonOptions::*, int DaemonOptions::*,
                 uint32_t DaemonOptions::*, uint64_t DaemonOptions::*, double DaemonOptions::*,
                 std::vector<std::string> DaemonOptions::*, std::vector<uint32_t> DaemonOptions::*>;

struct OptionSpec {
  const char* flag;        // without "--": "max-slot-memory"
  const char* value_name;  // in help and docs: "SIZE"
  OptionField field;
  const char* help;  // Markdown, one paragraph (backquotes dropped for --help)
  // The default as the docs say it; empty: the DaemonOptions default, printed.
  const char* default_text = "";
  // Numbers (and each element of an id list): the inclusive range.
  double min = 0;
  double max = 0;
  // Strings: the values allowed (empty: any).
  std::vector<std::string> choices = {};
  // uint64: a size, "64GiB" as well as a byte count (in flags and in the config file).
  bool size = false;
  // "" in the config file keeps the value it had (the node name: the host name); on the
  // command line "" is refused where the daemon checks the value.
  bool empty_keeps_default = false;

  // The config file's key: the flag with '-' written as '_'.
  std::string Key() const;
};

const std::vector<OptionSpec>& OptionTable();
const OptionSpec* FindByKey(const std::string& key);

// Sets `spec`'s field from text as given on the command line (lists: comma-separated).
// INVALID_ARGUMENT saying what the value must be (the caller names the flag or key).
absl::Status SetFromText(const OptionSpec& spec, const std::string& text, DaemonOptions* options);

// What the value must be, e.g. "must be an integer from 1 to 1000000".
std::string Expectation(const OptionSpec& spec);

// The help with the allowed values or range, as docs and --help show it.
std::string Describe(const OptionSpec& spec);

// The default as docs and --help show it.
std::string DefaultText(const OptionSpec& spec);

// "1073741824", "64GiB", "1.5 GiB", "512k": bytes (K/M/G/T with or without "iB"/"B" are
// powers of 1024). False for anything else or an overflow.
bool ParseSize(const std::string& text, uint64_t* bytes);

// The flag reference table and config-key paragraph of docs/api.md (between the markers
// "<!-- options:begin -->" and "<!-- options:end -->").
std::string RenderMarkdown();

}  // namespace refit::config
