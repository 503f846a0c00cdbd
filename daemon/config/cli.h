#pragma once

// refitd's command line, from the option table (option_table.h): one CLI11 option per entry,
// checked by the same rules as the config file, applied over it (flags win).

#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "daemon/config/option_table.h"
#include "daemon/options.h"

namespace refit::config {

class CommandLine {
 public:
  // Adds every option of OptionTable() to `app`; `app` must outlive this.
  explicit CommandLine(CLI::App* app);

  // After app.parse(): sets the options given on the command line, and only those.
  void ApplyGiven(DaemonOptions* options) const;

 private:
  struct Flag {
    const OptionSpec* spec;
    CLI::Option* option = nullptr;
    std::string text;  // as given; lists joined with ','
  };
  std::vector<std::unique_ptr<Flag>> flags_;
};

}  // namespace refit::config
