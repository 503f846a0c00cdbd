// fanout_bench: one trainer node, K engine nodes. Given K+1 running refitd (scripts/
// bench-fanout.sh starts them, one per network namespace, in a full mesh of --peers), it
// registers a bf16 model as SOURCE on the trainer's node and as DESTINATION (same layout) on
// every engine's node, publishes full versions (every byte changes: each 8-byte word is XORed
// with a random word whose bytes are all odd, so no delta helps), and measures per version:
//   T(K)     from Publish returning on the trainer's node to the version complete on the LAST
//            engine's node (WaitForVersion, in place on every engine before Publish);
//   trainer  the trainer node's refit_data_bytes_sent_total over the version, in models;
//   engines  the same counter summed over the engines' nodes (bytes they served to each
//            other: zero without relays), in models;
//   cpu      the CPU seconds all K+1 daemons used (utime + stime, found by their sockets'
//            SO_PEERCRED) from just before Publish until the counters above settled, Apply
//            not included: what a version costs the daemons, reported as the median of the
//            versions after the warm-up ones (cpu_s in RESULT).
// Then every engine Applies the version and its bytes are compared with the source, so a
// broken transfer fails the run instead of looking fast.
//
// The clients are threads of this one process: a client reaches its node's daemon over a Unix
// socket and POSIX shared memory, neither of which belongs to a network namespace, so one
// process on one steady clock (CLOCK_MONOTONIC) times every node. The daemons' own traffic
// crosses the namespaces. The last line is machine-readable (RESULT key=value ...).
//
//   fanout_bench --trainer-socket=T.sock --engine-sockets=E1.sock,E2.sock [--versions=5]
//                [--mib=256] [--timeout=300]

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/refit_client.h"
#include "tests/bench/bench_util.h"

namespace {

namespace v1 = refit::v1;
using refit::bench::Clock;
using refit::bench::CpuSeconds;
using refit::bench::Median;
using refit::bench::Metric;
using refit::bench::Seconds;
using refit::bench::SocketPeerPid;
using refit::bench::WaitConnected;
using refit::client::Client;
using refit::client::SharedMemory;
using refit::client::Slice;
using std::chrono::milliseconds;

constexpr char kSent[] = "refit_data_bytes_sent_total";

int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "fanout_bench: " << what << ": " << status.ToString() << "\n";
  return 1;
}

// `name` on every client, once two reads 100 ms apart agree: a source counts the bytes a
// puller read when the puller releases its pin, which may come just after the version
// completes on the puller.
absl::StatusOr<std::vector<double>> SettledMetric(const std::vector<Client*>& clients,
                                                  const char* name) {
  std::vector<double> last;
  for (int round = 0; round < 50; ++round) {
    std::vector<double> now;
    for (Client* c : clients) {
      auto value = Metric(*c, name);
      if (!value.ok()) return value.status();
      now.push_back(*value);
    }
    if (now == last) return now;
    last = std::move(now);
    std::this_thread::sleep_for(milliseconds(100));
  }
  return last;
}

// Until every one of `engines` lists `replicas` nodes with DESTINATION buffers for `model` in
// its Status; false after `timeout`.
bool WaitReplicasKnown(const std::vector<Client*>& engines, const std::string& model, int replicas,
                       std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    bool all = true;
    for (Client* engine : engines) {
      auto status = engine->Status();
      int known = 0;
      if (status.ok()) {
        for (const auto& m : status->models()) {
          if (m.model() == model) known = m.replicas_size();
        }
      }
      all = all && known >= replicas;
    }
    if (all) return true;
    std::this_thread::sleep_for(milliseconds(100));
  }
  return false;
}

// CPU seconds the daemons `pids` used so far, summed (a pid that can't be read counts 0).
double DaemonsCpuSeconds(const std::vector<int>& pids) {
  double total = 0;
  for (int pid : pids) total += std::max(0.0, CpuSeconds(pid));
  return total;
}

// The next full version in place: each word XORed with a random word whose bytes are all odd,
// so every byte changes and consecutive versions share nothing a delta could use.
void NextVersion(uint8_t* data, uint64_t bytes, uint64_t version) {
  uint64_t state = version * 0x9E3779B97F4A7C15ull;
  for (uint64_t at = 0; at + 8 <= bytes; at += 8) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    uint64_t word;
    std::memcpy(&word, data + at, 8);
    word ^= z | 0x0101010101010101ull;
    std::memcpy(data + at, &word, 8);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string trainer_socket, model = "fanout";
  std::vector<std::string> engine_sockets;
  int versions = 5, timeout_s = 300, warmup = 2;
  uint64_t mib = 256;
  CLI::App app{"refit fan-out benchmark: publish on one daemon, complete on K others"};
  app.add_option("--trainer-socket", trainer_socket, "the trainer node's refitd socket")
      ->required();
  app.add_option("--engine-sockets", engine_sockets, "the engine nodes' refitd sockets")
      ->required()
      ->delimiter(',');
  app.add_option("--warmup", warmup,
                 "versions reported apart, not in the medians (the first two allocate the "
                 "nodes' version slots: retain + 1 = 2 of them)")
      ->check(CLI::Range(1, 100));
  app.add_option("--versions", versions, "versions published (the first is reported apart)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000));
  app.add_option("--mib", mib, "model size in MiB (bf16, one tensor)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--model", model, "model name")->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds to wait for one version")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const uint64_t total = mib << 20;
  const int k = static_cast<int>(engine_sockets.size());
  const auto timeout = std::chrono::seconds(timeout_s);

  auto trainer = Client::Connect(trainer_socket);
  if (!trainer.ok()) return Fail("trainer node", trainer.status());
  (*trainer)->set_call_timeout(timeout);
  std::vector<std::unique_ptr<Client>> engines;
  for (const auto& socket : engine_sockets) {
    auto engine = Client::Connect(socket);
    if (!engine.ok()) return Fail("engine node " + socket, engine.status());
    (*engine)->set_call_timeout(timeout);
    engines.push_back(std::move(*engine));
  }
  std::vector<int> daemon_pids = {SocketPeerPid(trainer_socket)};
  for (const auto& socket : engine_sockets) daemon_pids.push_back(SocketPeerPid(socket));
  std::vector<Client*> all = {trainer->get()}, engine_clients;
  for (auto& e : engines) {
    all.push_back(e.get());
    engine_clients.push_back(e.get());
  }
  // Full mesh: every daemon sees the K others.
  for (Client* c : all) {
    if (!WaitConnected(*c, k, std::chrono::seconds(30))) {
      return Fail(c->socket_path(),
                  absl::UnavailableError(absl::StrFormat(
                      "fewer than %d peers connected after 30 s; check --peers and the "
                      "network",
                      k)));
    }
  }

  const std::string tag = std::to_string(getpid());
  auto src = SharedMemory::Create("/refit-fanout-trainer-" + tag, total);
  if (!src.ok()) return Fail("shared memory", src.status());
  std::vector<SharedMemory> dst;
  for (int i = 0; i < k; ++i) {
    auto d = SharedMemory::Create(absl::StrFormat("/refit-fanout-engine%d-%s", i + 1, tag), total);
    if (!d.ok()) return Fail("shared memory", d.status());
    dst.push_back(std::move(*d));
  }
  const std::vector<v1::TensorSlice> slices = {
      Slice("model.weight", v1::BF16, {static_cast<int64_t>(total / 2)})};
  auto src_id =
      (*trainer)->RegisterBuffer(model, v1::SOURCE, src->name(), slices, "fanout-trainer");
  if (!src_id.ok()) return Fail("RegisterBuffer SOURCE", src_id.status());
  std::vector<std::string> dst_ids;
  for (int i = 0; i < k; ++i) {
    auto id = engines[i]->RegisterBuffer(model, v1::DESTINATION, dst[i].name(), slices,
                                         absl::StrFormat("fanout-engine%d", i + 1));
    if (!id.ok()) return Fail("RegisterBuffer DESTINATION", id.status());
    dst_ids.push_back(*id);
  }
  // Engines learn of each other's DESTINATION buffers from reports sent every second; a version
  // published before that is pulled by each engine alone, from the trainer (no relays).
  if (!WaitReplicasKnown(engine_clients, model, k, std::chrono::seconds(10))) {
    std::cout << "fanout_bench: after 10 s not every engine knew all " << k
              << " replicas; the first version may be pulled without relays\n";
  }

  uint64_t base = 0;
  for (Client* c : all) {
    auto status = c->Status();
    if (!status.ok()) return Fail("Status", status.status());
    for (const auto& m : status->models()) {
      if (m.model() == model) base = std::max<uint64_t>(base, m.latest_version());
    }
  }

  const double model_bytes = static_cast<double>(total);
  std::cout << absl::StrFormat(
      "model %s: one bf16 tensor of %d bytes (%.0f MiB); 1 trainer node -> %d engine node(s)\n",
      model, total, model_bytes / (1 << 20), k);
  std::cout << absl::StrFormat("%-8s %9s %9s %9s %12s %12s %8s %6s\n", "version", "publish s",
                               "first s", "T(K) s", "trainer sent", "engines sent", "cpu s",
                               "check");
  std::cout << absl::StrFormat("%-8s %9s %9s %9s %12s %12s %8s\n", "", "", "engine", "last engine",
                               "models", "models", "daemons");
  std::vector<double> t_last, trainer_models, engine_models, cpu_versions;
  double first_t = 0, first_trainer = 0, first_engines = 0, trainer_all = 0;
  for (int i = 1; i <= versions; ++i) {
    const uint64_t version = base + static_cast<uint64_t>(i);
    NextVersion(src->data(), total, version);
    auto before = SettledMetric(all, kSent);
    if (!before.ok()) return Fail("Status", before.status());

    // Every engine waits from before Publish, as an inference engine's refit loop would.
    std::vector<absl::StatusOr<uint64_t>> ready(k, absl::UnknownError("not waited"));
    std::vector<Clock::time_point> t_ready(k);
    std::vector<std::thread> waiters;
    for (int e = 0; e < k; ++e) {
      waiters.emplace_back([&, e] {
        ready[e] = engines[e]->WaitForVersion(model, version, timeout);
        t_ready[e] = Clock::now();
      });
    }
    std::this_thread::sleep_for(milliseconds(50));  // let the waits be in place
    const double cpu0 = DaemonsCpuSeconds(daemon_pids);
    const auto t0 = Clock::now();
    auto published = (*trainer)->Publish(model, version, {*src_id});
    const auto t1 = Clock::now();
    for (auto& w : waiters) w.join();
    if (!published.ok()) return Fail("Publish", published.status());
    for (int e = 0; e < k; ++e) {
      if (!ready[e].ok()) {
        return Fail(absl::StrFormat("engine %d WaitForVersion %d", e + 1, version),
                    ready[e].status());
      }
    }
    const auto first = *std::min_element(t_ready.begin(), t_ready.end());
    const auto last = *std::max_element(t_ready.begin(), t_ready.end());

    auto after = SettledMetric(all, kSent);
    if (!after.ok()) return Fail("Status", after.status());
    const double cpu = DaemonsCpuSeconds(daemon_pids) - cpu0;
    const double trainer_sent = ((*after)[0] - (*before)[0]) / model_bytes;
    double engines_sent = 0;
    for (int e = 1; e <= k; ++e) engines_sent += (*after)[e] - (*before)[e];
    engines_sent /= model_bytes;

    bool ok = true;
    for (int e = 0; e < k; ++e) {
      auto applied = engines[e]->Apply(model, version, {dst_ids[e]});
      if (!applied.ok()) return Fail(absl::StrFormat("engine %d Apply", e + 1), applied.status());
      ok = ok && std::memcmp(dst[e].data(), src->data(), total) == 0;
    }
    const double t = Seconds(t1, last);
    std::cout << absl::StrFormat("%-8s %9.3f %9.3f %9.3f %12.3f %12.3f %8.2f %6s\n",
                                 absl::StrCat(version, i == 1 ? " (1st)" : ""), Seconds(t0, t1),
                                 Seconds(t1, first), t, trainer_sent, engines_sent, cpu,
                                 ok ? "ok" : "WRONG");
    std::cout.flush();
    if (!ok) {
      std::cerr << "fanout_bench: version " << version
                << ": an engine's bytes differ from the source after Apply\n";
      return 1;
    }
    trainer_all += trainer_sent;
    if (i == 1) {
      first_t = t;
      first_trainer = trainer_sent;
      first_engines = engines_sent;
    } else if (i > warmup || versions <= warmup) {
      t_last.push_back(t);
      cpu_versions.push_back(cpu);
      trainer_models.push_back(trainer_sent);
      engine_models.push_back(engines_sent);
    }
  }

  std::vector<std::string> times;
  for (double t : t_last) times.push_back(absl::StrFormat("%.6f", t));
  std::cout << absl::StrFormat(
      "K=%d: T(K) median of versions %d-%d %.3f s (first version %.3f s); trainer sent %.3f "
      "models per version, engines %.3f; the %d daemons used %.2f CPU s per version (median); "
      "every engine's bytes checked after Apply\n",
      k, versions <= warmup ? 2 : warmup + 1, versions, Median(t_last), first_t,
      Median(trainer_models), Median(engine_models), k + 1, Median(cpu_versions));
  std::cout << absl::StrFormat(
      "RESULT k=%d bytes=%d versions=%d t_s=%.6f first_s=%.6f trainer_models=%.4f "
      "engines_models=%.4f first_trainer_models=%.4f first_engines_models=%.4f "
      "trainer_mean_models=%.4f cpu_s=%.3f times=%s\n",
      k, total, versions, Median(t_last), first_t, Median(trainer_models), Median(engine_models),
      first_trainer, first_engines, trainer_all / versions, Median(cpu_versions),
      absl::StrJoin(times, ","));
  for (int e = 0; e < k; ++e) (void)engines[e]->ReleaseBuffer(dst_ids[e]);
  (void)(*trainer)->ReleaseBuffer(*src_id);
  return 0;
}
