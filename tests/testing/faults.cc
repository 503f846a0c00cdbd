#include "tests/testing/faults.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"

namespace refit::testing {
namespace {

constexpr char kShmDir[] = "/dev/shm/";
constexpr char kTestPrefix[] = "/dev/shm/refit-test-";

void AddIfRefitd(const std::string& path, std::set<std::string>* out) {
  if (path.rfind(kShmDir, 0) != 0 || path.rfind(kTestPrefix, 0) == 0) return;
  if (path.find(" (deleted)") != std::string::npos) return;
  out->insert(path);
}

}  // namespace

int Iterations(int fallback) {
  const char* n = std::getenv("REFIT_FAULTS_ITERATIONS");
  return n && std::atoi(n) > 0 ? std::atoi(n) : fallback;
}

void PrintFigure(const std::string& name, std::vector<double> values, const std::string& unit) {
  if (values.empty()) {
    PrintFigureText(name, "n=0");
    return;
  }
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const double median = n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  PrintFigureText(name, absl::StrCat("n=", n, " median=", median, " max=", values.back(),
                                     " min=", values.front(), " ", unit));
}

void PrintFigureText(const std::string& name, const std::string& text) {
  std::printf("FIGURE %s %s\n", name.c_str(), text.c_str());
  std::fflush(stdout);
}

void FillPattern(client::SharedMemory& memory, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 1);
  uint64_t* p = reinterpret_cast<uint64_t*>(memory.data());
  for (uint64_t i = 0; i < memory.size() / 8; ++i) p[i] = rng();
}

bool HoldsPattern(const client::SharedMemory& memory, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 1);
  const uint64_t* p = reinterpret_cast<const uint64_t*>(memory.data());
  for (uint64_t i = 0; i < memory.size() / 8; ++i) {
    if (p[i] != rng()) return false;
  }
  return true;
}

std::set<std::string> ShmObjectsOf(pid_t pid) {
  std::set<std::string> out;
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* dir = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(dir)) {
      char target[4096];
      const std::string link = fd_dir + "/" + e->d_name;
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n > 0) AddIfRefitd(std::string(target, static_cast<size_t>(n)), &out);
    }
    closedir(dir);
  }
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  while (std::getline(maps, line)) {
    const size_t at = line.find(kShmDir);
    if (at != std::string::npos) AddIfRefitd(line.substr(at), &out);
  }
  return out;
}

std::set<std::string> StillInShm(const std::set<std::string>& names) {
  std::set<std::string> out;
  for (const std::string& name : names) {
    struct stat st;
    if (stat(name.c_str(), &st) == 0) out.insert(name);
  }
  return out;
}

double Metric(client::Client& client, const std::string& name) {
  auto status = client.Status();
  if (!status.ok()) return -1;
  auto it = status->metrics().find(name);
  return it == status->metrics().end() ? -1 : it->second;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace refit::testing
