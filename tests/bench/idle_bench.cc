// idle_bench: what two connected refitd cost while nothing happens. Given two running refitd —
// the trainer's node and the engine's node, the engine's started with --peers=<the trainer's
// --listen> — it registers a small bf16 model as SOURCE on the trainer's node and as
// DESTINATION on the engine's node, publishes one version and waits until the engine's node has
// pulled it (so endpoints, registrations and imported slots exist on both), lets --settle
// seconds pass, then reads each daemon's CPU time (utime + stime in /proc/PID/stat) before and
// after --seconds of nothing, holding the buffers registered. It prints each daemon's share of
// one core over that window, and beside it, as a reference from the same run, what this
// process's own idle thread cost (a sleeping thread: the floor a daemon is measured against).
// The last line is machine-readable (RESULT key=value ...). scripts/bench/bench-idle.sh starts the
// daemons and runs it.
//
//   idle_bench --trainer-socket=A.sock --engine-socket=B.sock [--seconds=60] [--settle=5]

#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "client/refit_client.h"
#include "tests/bench/bench_util.h"

namespace {

namespace v1 = refit::v1;
using refit::bench::Clock;
using refit::client::Client;
using refit::client::SharedMemory;
using refit::client::Slice;

int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "idle_bench: " << what << ": " << status.ToString() << "\n";
  return 1;
}

// utime + stime of process `pid` in seconds (fields 14 and 15 of /proc/PID/stat); < 0 if gone.
double CpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return -1;
  // The command (field 2) is in parentheses and may hold spaces: count from the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace

int main(int argc, char** argv) {
  std::string trainer_socket, engine_socket, model = "idle";
  int seconds = 60, settle = 5;
  uint64_t mib = 4;
  CLI::App app{"refit idle benchmark: CPU of two connected daemons with nothing to do"};
  app.add_option("--trainer-socket", trainer_socket, "the trainer node's refitd socket")
      ->required();
  app.add_option("--engine-socket", engine_socket, "the engine node's refitd socket")->required();
  app.add_option("--seconds", seconds, "the measured idle window")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  app.add_option("--settle", settle, "seconds between the pull and the window")
      ->capture_default_str()
      ->check(CLI::Range(0, 600));
  app.add_option("--mib", mib, "model size in MiB (bf16); 0: no model, only connected peers")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
  app.add_option("--model", model, "model name")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto trainer = Client::Connect(trainer_socket);
  if (!trainer.ok()) return Fail("trainer node", trainer.status());
  auto engine = Client::Connect(engine_socket);
  if (!engine.ok()) return Fail("engine node", engine.status());
  if (!refit::bench::WaitConnected(**engine, 1, std::chrono::seconds(20))) {
    return Fail("engine node", absl::UnavailableError("its peer never connected (--peers)"));
  }
  const int trainer_pid = refit::bench::SocketPeerPid(trainer_socket);
  const int engine_pid = refit::bench::SocketPeerPid(engine_socket);
  if (trainer_pid == 0 || engine_pid == 0) {
    return Fail("pids", absl::NotFoundError("cannot find the daemons' pids (SO_PEERCRED)"));
  }

  uint64_t version = 0;
  const uint64_t total = mib << 20;
  const std::string tag = std::to_string(getpid());
  std::optional<SharedMemory> src, dst;
  if (mib > 0) {
    auto made_src = SharedMemory::Create("/refit-idle-trainer-" + tag, total);
    if (!made_src.ok()) return Fail("shared memory", made_src.status());
    auto made_dst = SharedMemory::Create("/refit-idle-engine-" + tag, total);
    if (!made_dst.ok()) return Fail("shared memory", made_dst.status());
    src.emplace(std::move(*made_src));
    dst.emplace(std::move(*made_dst));
    const std::vector<v1::TensorSlice> slices = {
        Slice("model.weight", v1::BF16, {static_cast<int64_t>(total / 2)}, 0)};
    auto src_id =
        (*trainer)->RegisterBuffer(model, v1::SOURCE, src->name(), slices, "idle-trainer");
    if (!src_id.ok()) return Fail("RegisterBuffer SOURCE", src_id.status());
    auto dst_id =
        (*engine)->RegisterBuffer(model, v1::DESTINATION, dst->name(), slices, "idle-engine");
    if (!dst_id.ok()) return Fail("RegisterBuffer DESTINATION", dst_id.status());
    version = 1;
    if (auto status = (*trainer)->Status(); status.ok()) {
      for (const auto& m : status->models()) {
        if (m.model() == model) version = m.latest_version() + 1;
      }
    }
    std::memset(src->data(), static_cast<int>(version & 0xff), total);
    auto published = (*trainer)->Publish(model, version, {*src_id});
    if (!published.ok()) return Fail("Publish", published.status());
    auto ready = (*engine)->WaitForVersion(model, version, std::chrono::seconds(60));
    if (!ready.ok()) return Fail("WaitForVersion", ready.status());
    auto applied = (*engine)->Apply(model, version, {*dst_id});
    if (!applied.ok()) return Fail("Apply", applied.status());
    if (std::memcmp(dst->data(), src->data(), total) != 0) {
      return Fail("Apply", absl::DataLossError("the engine's bytes differ from the trainer's"));
    }
  }

  std::this_thread::sleep_for(std::chrono::seconds(settle));
  const double trainer0 = CpuSeconds(trainer_pid), engine0 = CpuSeconds(engine_pid);
  timespec self0{}, self1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &self0);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  const double wall = refit::bench::Seconds(t0, Clock::now());
  const double trainer1 = CpuSeconds(trainer_pid), engine1 = CpuSeconds(engine_pid);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &self1);
  if (trainer0 < 0 || engine0 < 0 || trainer1 < 0 || engine1 < 0) {
    return Fail("/proc", absl::NotFoundError("a daemon went away during the window"));
  }
  const double self = (self1.tv_sec - self0.tv_sec) + (self1.tv_nsec - self0.tv_nsec) / 1e9;
  const double trainer_pct = 100 * (trainer1 - trainer0) / wall;
  const double engine_pct = 100 * (engine1 - engine0) / wall;
  std::cout << absl::StrFormat(
      "idle %.1f s, peers connected, %s:\n"
      "  trainer's refitd (pid %d): %.3f %% of a core (%.2f s CPU)\n"
      "  engine's refitd  (pid %d): %.3f %% of a core (%.2f s CPU)\n"
      "  this process (a client holding its buffers, asleep): %.3f %% of a core\n",
      wall,
      mib == 0 ? std::string("no model")
               : absl::StrFormat("a %d MiB model registered and pulled (version %d)", mib, version),
      trainer_pid, trainer_pct, trainer1 - trainer0, engine_pid, engine_pct, engine1 - engine0,
      100 * self / wall);
  std::cout << absl::StrFormat(
      "RESULT seconds=%.1f trainer_pct=%.3f engine_pct=%.3f self_pct=%.3f\n", wall, trainer_pct,
      engine_pct, 100 * self / wall);
  return 0;
}
