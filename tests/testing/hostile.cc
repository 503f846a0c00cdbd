#include "tests/testing/hostile.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "catch2/catch.hpp"

namespace refit::testing {

Hostile::Hostile() {
  char dir_template[] = "/tmp/refit-hostile-XXXXXX";
  REQUIRE(mkdtemp(dir_template));
  dir_ = dir_template;
  chmod(dir_.c_str(), 0755);
  binary_ = dir_ + "/hostile_client";
  std::filesystem::copy_file(RunfilePath("tests/testing/hostile_client"), binary_);
  chmod(binary_.c_str(), 0755);
  as_client_ = dir_ + "/as_client";
  std::filesystem::copy_file(RunfilePath("tests/testing/as_client"), as_client_);
  chmod(as_client_.c_str(), 0755);
}

Hostile::~Hostile() { std::filesystem::remove_all(dir_); }

std::vector<std::string> Hostile::Argv(uid_t uid, const std::string& socket,
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

Hostile::Held Hostile::Hold(uid_t uid, const std::string& socket,
                            const std::vector<std::string>& args) const {
  auto child = ChildProcess::Spawn(Argv(uid, socket, args));
  REQUIRE(child.ok());
  auto line = (*child)->ReadLine(60);
  INFO("hostile_client as uid " << uid);
  REQUIRE(line.ok());
  INFO(*line);
  REQUIRE(line->rfind("OK", 0) == 0);
  return Held{std::move(child).value(), *line};
}

std::string Hostile::Run(uid_t uid, const std::string& socket,
                         const std::vector<std::string>& args) const {
  auto result = RunCommand(Argv(uid, socket, args));
  INFO("hostile_client as uid " << uid << ": " << result.out << result.err);
  REQUIRE(result.exit_code == 0);
  REQUIRE(result.out.rfind("OK", 0) == 0);
  return result.out;
}

std::map<std::string, int> ParseCounts(const std::string& line) {
  std::map<std::string, int> counts;
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq == std::string::npos) continue;
    counts[word.substr(0, eq)] = std::atoi(word.c_str() + eq + 1);
  }
  return counts;
}

int ParseCounts(const std::string& line, const std::string& key) {
  auto counts = ParseCounts(line);
  auto it = counts.find(key);
  return it == counts.end() ? -1 : it->second;
}

void OpenSocketToAll(const std::string& socket) {
  for (auto p = std::filesystem::path(socket).parent_path();
       p.string().size() > 1 && p.string().rfind("/tmp/", 0) == 0; p = p.parent_path()) {
    chmod(p.c_str(), 0755);
  }
  chmod(socket.c_str(), 0666);
}

namespace {
long StatusField(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return -1;
}
}  // namespace

long ThreadsOf(pid_t pid) { return StatusField(pid, "Threads"); }
long RssKiBOf(pid_t pid) { return StatusField(pid, "VmRSS"); }

long FdsOf(pid_t pid) {
  std::error_code ec;
  long n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

}  // namespace refit::testing
