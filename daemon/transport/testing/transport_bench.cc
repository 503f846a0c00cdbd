// GET throughput of the UCX transport between two processes: a forked peer serves a buffer, this
// process reads all of it in chunks with N ops in flight and prints GB/s (median of several
// runs). UCX picks its transports from the environment, as in the daemon:
//
//   UCX_TLS=tcp UCX_NET_DEVICES=lo transport_bench --chunk=4M,16M --inflight=4,16
//   UCX_TLS=sm,self transport_bench --no-peer-failure-handling
//
// UCX 1.13 refuses shared memory for endpoints with peer-failure handling (what the daemon
// uses), hence the flag for the second line; see ucx_transport.h. Compare with
//   ucx_perftest -t ucp_get -s <chunk> [-O <inflight>] [-e]   (server and client on 127.0.0.1,
// same UCX_TLS; -e = peer-failure handling). Flags: --size (default 1G), --chunk (list, default
// 4M), --inflight (list, default 16), --runs (default 5), --no-peer-failure-handling. Sizes take
// K/M/G suffixes.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "daemon/transport/testing/peer_process.h"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit::transport {
namespace {

bool ParseSize(std::string_view text, uint64_t* out) {
  uint64_t scale = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        scale = 1ull << 10;
        break;
      case 'M':
      case 'm':
        scale = 1ull << 20;
        break;
      case 'G':
      case 'g':
        scale = 1ull << 30;
        break;
      default:
        break;
    }
    if (scale != 1) text.remove_suffix(1);
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    return false;
  }
  uint64_t v = std::strtoull(std::string(text).c_str(), nullptr, 10);
  if (v == 0) return false;
  *out = v * scale;
  return true;
}

bool ParseList(std::string_view text, std::vector<uint64_t>* out) {
  out->clear();
  while (true) {
    size_t comma = text.find(',');
    uint64_t v;
    if (!ParseSize(text.substr(0, comma), &v)) return false;
    out->push_back(v);
    if (comma == std::string_view::npos) return true;
    text.remove_prefix(comma + 1);
  }
}

// One timed GET of [0, size) with `inflight` ops of `chunk` bytes; seconds, or <0 on failure.
double TimedGet(Transport& t, Endpoint& ep, const LocalMemory& local, const RemoteMemory& remote,
                uint64_t size, uint64_t chunk, uint64_t inflight) {
  std::vector<Completion> done;
  uint64_t next = 0, posted = 0, completed = 0;
  auto start = std::chrono::steady_clock::now();
  while (completed < posted || next < size) {
    while (next < size && posted - completed < inflight) {
      uint64_t n = std::min(chunk, size - next);
      absl::Status s = ep.PostGet(local, next, remote, next, n, posted);
      if (!s.ok()) {
        std::fprintf(stderr, "post: %s\n", s.ToString().c_str());
        return -1;
      }
      next += n;
      ++posted;
    }
    done.clear();
    t.Poll(&done);
    for (const Completion& c : done) {
      if (!c.status.ok()) {
        std::fprintf(stderr, "op %llu: %s\n", static_cast<unsigned long long>(c.cookie),
                     c.status.ToString().c_str());
        return -1;
      }
    }
    completed += done.size();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int Main(int argc, char** argv) {
  uint64_t size = 1ull << 30, runs = 5;
  std::vector<uint64_t> chunks = {4ull << 20}, inflights = {16};
  UcxTransport::Options options;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    auto value = [&](std::string_view flag) -> std::string_view { return arg.substr(flag.size()); };
    bool ok = true;
    if (arg.rfind("--size=", 0) == 0) {
      ok = ParseSize(value("--size="), &size);
    } else if (arg.rfind("--chunk=", 0) == 0) {
      ok = ParseList(value("--chunk="), &chunks);
    } else if (arg.rfind("--inflight=", 0) == 0) {
      ok = ParseList(value("--inflight="), &inflights);
    } else if (arg == "--no-peer-failure-handling") {
      options.peer_failure_handling = false;
    } else if (arg.rfind("--runs=", 0) == 0) {
      ok = ParseSize(value("--runs="), &runs);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: %s [--size=1G] [--chunk=4M,...] [--inflight=16,...] [--runs=5] "
                   "[--no-peer-failure-handling]\n",
                   argv[0]);
      return 2;
    }
  }

  const uint64_t seed = 1234;
  TransportFactory make = [options]() -> absl::StatusOr<std::unique_ptr<Transport>> {
    auto t = UcxTransport::Create(options);
    if (!t.ok()) return t.status();
    return std::unique_ptr<Transport>(std::move(*t));
  };
  auto peer = PeerProcess::Start(make, size, seed);  // fork before this process touches UCX
  if (!peer.ok()) {
    std::fprintf(stderr, "peer: %s\n", peer.status().ToString().c_str());
    return 1;
  }
  auto transport = make();
  if (!transport.ok()) {
    std::fprintf(stderr, "transport: %s\n", transport.status().ToString().c_str());
    return 1;
  }
  Transport& t = **transport;
  std::unique_ptr<uint8_t[]> buffer(new uint8_t[size]);
  std::memset(buffer.get(), 0, size);  // fault the pages in before timing
  auto local = t.RegisterMemory(buffer.get(), size, MemoryKind::kHost);
  auto ep = t.Connect((*peer)->address());
  if (!local.ok() || !ep.ok()) {
    std::fprintf(stderr, "setup: %s %s\n", local.status().ToString().c_str(),
                 ep.status().ToString().c_str());
    return 1;
  }
  auto remote = (*ep)->ImportRemote((*peer)->descriptor());
  if (!remote.ok()) {
    std::fprintf(stderr, "import: %s\n", remote.status().ToString().c_str());
    return 1;
  }

  const char* tls = std::getenv("UCX_TLS");
  std::printf("transport_bench: GET %llu MiB from a forked peer, UCX_TLS=%s, %s\n",
              static_cast<unsigned long long>(size >> 20), tls ? tls : "(default)",
              t.capabilities().detail.c_str());
  // median/min/max over runs; "overall" is all bytes over all time (what ucx_perftest's
  // "overall" bandwidth reports).
  std::printf("%10s %9s %12s %10s %10s %10s\n", "chunk", "inflight", "median", "min", "max",
              "overall");
  int status = 0;
  for (uint64_t chunk : chunks) {
    for (uint64_t inflight : inflights) {
      std::vector<double> rates;
      double total_seconds = 0;
      // One untimed warm-up run (wireup, first-touch of UCX's own buffers).
      for (uint64_t r = 0; r <= runs; ++r) {
        double seconds = TimedGet(t, **ep, **local, **remote, size, chunk, inflight);
        if (seconds < 0) return 1;
        if (r == 0) continue;
        rates.push_back(static_cast<double>(size) / seconds / 1e9);
        total_seconds += seconds;
      }
      std::sort(rates.begin(), rates.end());
      std::printf("%9lluK %9llu %7.2f GB/s %5.2f GB/s %5.2f GB/s %5.2f GB/s\n",
                  static_cast<unsigned long long>(chunk >> 10),
                  static_cast<unsigned long long>(inflight), rates[rates.size() / 2], rates.front(),
                  rates.back(), static_cast<double>(size) * runs / total_seconds / 1e9);
      std::fflush(stdout);
      std::memset(buffer.get(), 0, size);
      if (TimedGet(t, **ep, **local, **remote, size, chunk, inflight) < 0) return 1;
      int64_t bad = FindPatternMismatch(buffer.get(), size, seed, 0);
      if (bad >= 0) {
        std::printf("  DATA MISMATCH at byte %lld\n", static_cast<long long>(bad));
        status = 1;
      }
    }
  }
  remote->reset();
  ep->reset();
  local->reset();
  return status;
}

}  // namespace
}  // namespace refit::transport

int main(int argc, char** argv) { return refit::transport::Main(argc, argv); }
