#pragma once

// One named spdlog logger per component ("store", "server", "transport", "peer", "daemon").

#include <memory>
#include <string>

#include "spdlog/spdlog.h"

namespace refit {

// Returns the logger named `component`, creating it (stderr, shared level) on first use.
// Thread-safe.
std::shared_ptr<spdlog::logger> Logger(const std::string& component);

// Sets the level of every refit logger: trace, debug, info, warn, error. Returns false for an
// unknown name.
bool SetLogLevel(const std::string& level);

}  // namespace refit
