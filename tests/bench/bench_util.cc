#include "tests/bench/bench_util.h"

#include <algorithm>
#include <thread>

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

}  // namespace refit::bench
