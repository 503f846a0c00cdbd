#include "tests/testing/as_uid.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <utility>

#include "catch2/catch.hpp"

namespace refit::testing {

AsUid::AsUid(const std::string& runfile) {
  char dir_template[] = "/tmp/refit-as-uid-XXXXXX";
  REQUIRE(mkdtemp(dir_template));
  dir_ = dir_template;
  chmod(dir_.c_str(), 0755);
  binary_ = dir_ + "/" + std::filesystem::path(runfile).filename().string();
  std::filesystem::copy_file(RunfilePath(runfile), binary_);
  chmod(binary_.c_str(), 0755);
}

AsUid::~AsUid() { std::filesystem::remove_all(dir_); }

std::vector<std::string> AsUid::Argv(uid_t uid, const std::string& socket,
                                     const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {"/usr/bin/setpriv",
                                   "--reuid=" + std::to_string(uid),
                                   "--regid=" + std::to_string(uid),
                                   "--clear-groups",
                                   binary_,
                                   socket};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::string AsUid::Run(uid_t uid, const std::string& socket,
                       const std::vector<std::string>& args) const {
  auto result = RunCommand(Argv(uid, socket, args));
  INFO(binary_ << " as uid " << uid << ": " << result.out << result.err);
  REQUIRE(result.exit_code == 0);
  return result.out;
}

std::unique_ptr<ChildProcess> AsUid::Spawn(uid_t uid, const std::string& socket,
                                           const std::vector<std::string>& args) const {
  auto child = ChildProcess::Spawn(Argv(uid, socket, args));
  REQUIRE(child.ok());
  return std::move(child).value();
}

void OpenSocketToAll(const std::string& socket) {
  for (auto p = std::filesystem::path(socket).parent_path();
       p.string().size() > 1 && p.string().rfind("/tmp/", 0) == 0; p = p.parent_path()) {
    chmod(p.c_str(), 0755);
  }
  chmod(socket.c_str(), 0666);
}

}  // namespace refit::testing
