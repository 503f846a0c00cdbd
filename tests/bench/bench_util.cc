#include "tests/bench/bench_util.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace refit::bench {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

absl::StatusOr<double> Metric(client::Client& client, const std::string& name) {
  auto status = client.Status();
  if (!status.ok()) return status.status();
  auto it = status->metrics().find(name);
  return it == status->metrics().end() ? 0 : it->second;
}

bool WaitConnected(client::Client& client, int peers, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto status = client.Status();
    if (status.ok()) {
      int connected = 0;
      for (const auto& p : status->peers()) connected += p.connected();
      if (connected >= peers) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

int SocketPeerPid(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int pid = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) pid = cred.pid;
  }
  close(fd);
  return pid;
}

absl::StatusOr<ResidentMemory> ReadResidentMemory(int pid,
                                                  const std::vector<std::string>& mapped_names) {
  ResidentMemory out;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  if (!status) return absl::NotFoundError(absl::StrCat("no process ", pid));
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream fields(line);
    std::string key;
    uint64_t kib = 0;
    fields >> key >> kib;
    if (key == "VmRSS:") out.rss = kib << 10;
    if (key == "RssAnon:") out.anon = kib << 10;
    if (key == "RssShmem:") out.shmem = kib << 10;
  }
  if (mapped_names.empty()) return out;
  std::ifstream smaps(absl::StrCat("/proc/", pid, "/smaps"));
  bool matching = false;
  while (std::getline(smaps, line)) {
    // A mapping's header: "start-end perms offset dev inode [path]".
    const size_t dash = line.find('-');
    if (dash != std::string::npos && dash > 0 && line.rfind("Rss:", 0) != 0 &&
        std::all_of(line.begin(), line.begin() + dash,
                    [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
      matching = std::any_of(mapped_names.begin(), mapped_names.end(), [&](const std::string& n) {
        return line.find(n) != std::string::npos;
      });
      continue;
    }
    if (matching && line.rfind("Rss:", 0) == 0) {
      std::istringstream fields(line.substr(4));
      uint64_t kib = 0;
      fields >> kib;
      out.mapped += kib << 10;
    }
  }
  return out;
}

double CpuSeconds(int pid) {
  if (pid <= 0) return -1;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(text.substr(close + 2));
  std::string f;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stod(f);
    if (i == 15) stime = std::stod(f);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace refit::bench
