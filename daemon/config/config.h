#pragma once

// refitd's configuration file (TOML, read with toml++). Its keys are the flag names with '-'
// written as '_', and each value is checked by the same rules as the flag (option_table.h).
// Flags given on the command line override the file. Unknown keys and bad values are rejected
// with a message naming the key. See deploy/refitd.toml for a documented sample.

#include <string>

#include "absl/status/status.h"
#include "daemon/options.h"

namespace refit {

// Reads `path` into `options` (only the keys present change). INVALID_ARGUMENT naming the key
// for an unknown key or a bad value, NOT_FOUND when the file can't be read.
absl::Status LoadConfigFile(const std::string& path, DaemonOptions* options);

// Same, from TOML text (`origin` names it in messages).
absl::Status ParseConfig(const std::string& text, const std::string& origin,
                         DaemonOptions* options);

}  // namespace refit
