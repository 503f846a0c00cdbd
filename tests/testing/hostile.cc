#include "tests/testing/hostile.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "catch2/catch.hpp"

namespace refit::testing {

Hostile::Hostile()
    : hostile_client_("tests/testing/hostile_client"), as_client_("tests/testing/as_client") {}

Hostile::Held Hostile::Hold(uid_t uid, const std::string& socket,
                            const std::vector<std::string>& args) const {
  std::unique_ptr<ChildProcess> child = hostile_client_.Spawn(uid, socket, args);
  auto line = child->ReadLine(60);
  INFO("hostile_client as uid " << uid);
  REQUIRE(line.ok());
  INFO(*line);
  REQUIRE(line->rfind("OK", 0) == 0);
  return Held{std::move(child), *line};
}

std::string Hostile::Run(uid_t uid, const std::string& socket,
                         const std::vector<std::string>& args) const {
  std::string out = hostile_client_.Run(uid, socket, args);
  INFO("hostile_client as uid " << uid << ": " << out);
  REQUIRE(out.rfind("OK", 0) == 0);
  return out;
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
