// two_node_bench: the two-node data path under load. Given two running refitd — the trainer's
// node and the engine's node, the engine's started with --peers=<the trainer's --listen> — it
// registers a ~1 GiB bf16 model as SOURCE on the trainer's node and as DESTINATION (same layout)
// on the engine's node, publishes versions, and measures per version:
//   publish   Publish's round trip on the trainer's node (the local snapshot);
//   transfer  from Publish returning on the trainer's node to WaitForVersion returning on the
//             engine's node: announce, pin, UCX pull, XXH3 verification, completion;
//   apply     Apply's round trip on the engine's node (staging slot -> destination buffer).
// Every version is checked byte for byte after Apply. --tensors=N splits the same bytes into N
// tensors. --density=F makes each version an RL-like step instead: F of the elements move by
// one unit in the last place (the first version is random), so deltas carry the versions; the
// "bytes pulled" column then shows the wire bytes. The last line is machine-readable
// (RESULT key=value ...) for scripts.
//
//   two_node_bench --trainer-socket=A.sock --engine-socket=B.sock [--versions=5] [--warmup=1]
//                  [--mib=1024] [--tensors=1] [--density=0] [--engine-shard=none] [--memory]
//
// --memory also reports both daemons' resident memory after the last version (the daemons are
// found through their sockets, SO_PEERCRED): VmRSS, the part of it that is the clients' own
// buffers mapped into the daemon (shared with the client, not memory refit adds), refit's own
// (the rest: version slots, deltas, the process), its peak while the versions ran (sampled
// every 10 ms), and each daemon's slot figures per model from Status; all beside the model.
// scripts/bench/bench-memory.sh runs it for full and delta versions at --retain 1 and 2.
//
// --engine-shard=rows|cols makes the model one [N/8192, 8192] tensor of which the engine's node
// holds half: the first half of the rows (a contiguous range of the source: the same bytes,
// not resharded) or the first half of the columns (one 8 KiB range per row, strided into the
// engine's buffer: a tensor-parallel reshard). Run both for resharded ÷ unresharded.
//
// --engine=fp8 makes the engine's node an fp8 engine: the model is 2-D bf16 tensors [rows, 8192]
// on the trainer's node, and each is an FP8_E4M3 DESTINATION with [128, 128] block scales in an
// FP32 tensor "<name>_scale_inv" on the engine's node, quantized there before the version
// completes. Each version is checked after Apply against the same quantization computed here
// (cuda::cpu::QuantizeFp8Blocks, bit-exact with the scalar reference: quantize_kernels_test).
// --matrix gives a bf16 engine the same 2-D tensors, for fp8 ÷ bf16 on the same layout
// (scripts/bench/bench-two-node.sh --engine "bf16 fp8" runs both and prints the ratios).

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "client/refit_client.h"
#include "cuda/quantize_kernels.h"
#include "tests/bench/bench_util.h"

namespace {

namespace v1 = refit::v1;
using refit::bench::Clock;
using refit::bench::CpuSeconds;
using refit::bench::Median;
using refit::bench::Seconds;
using refit::bench::WaitConnected;
using refit::client::Client;
using refit::client::SharedMemory;
using refit::client::Slice;

int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "two_node_bench: " << what << ": " << status.ToString() << "\n";
  return 1;
}

// What the engine's node has pulled so far (0 if its Status fails).
double Received(Client& engine) {
  return refit::bench::Metric(engine, "refit_data_bytes_received_total").value_or(0);
}

// Samples the resident memory of both daemons every 10 ms until stopped: the peak of each.
class RssSampler {
 public:
  explicit RssSampler(std::vector<int> pids) : pids_(std::move(pids)), peak_(pids_.size()) {
    thread_ = std::thread([this] {
      while (!stop_) {
        for (size_t i = 0; i < pids_.size(); ++i) {
          auto m = refit::bench::ReadResidentMemory(pids_[i], {});
          if (m.ok()) peak_[i] = std::max(peak_[i], m->rss);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  std::vector<uint64_t> Stop() {
    stop_ = true;
    thread_.join();
    return peak_;
  }

 private:
  std::vector<int> pids_;
  std::vector<uint64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// One daemon's memory after the run; returns the RESULT fields.
std::string ReportMemory(const std::string& who, const std::string& key, int pid, uint64_t peak,
                         Client& client, const std::string& model, uint64_t model_bytes) {
  auto m = refit::bench::ReadResidentMemory(pid, {"refit-bench-"});
  if (!m.ok()) {
    std::cout << "  " << who << ": " << m.status().ToString() << "\n";
    return "";
  }
  const double gib = 1 << 30, size = static_cast<double>(model_bytes);
  const uint64_t own = m->rss - std::min(m->rss, m->mapped);
  const uint64_t own_peak = peak - std::min(peak, m->mapped);
  std::cout << absl::StrFormat(
      "  %-15s RSS %6.2f GiB (%4.2fx); clients' buffers mapped %5.2f GiB; refit's own %5.2f GiB "
      "(%4.2fx), peak %5.2f GiB (%4.2fx)\n",
      who + ":", m->rss / gib, m->rss / size, m->mapped / gib, own / gib, own / size,
      own_peak / gib, own_peak / size);
  auto status = client.Status();
  double slots = 0;
  uint64_t held = 0, spare = 0, in_flight = 0, budget = 0;
  if (status.ok()) {
    slots = status->metrics().count("refit_slot_memory_bytes")
                ? status->metrics().at("refit_slot_memory_bytes")
                : 0;
    for (const auto& s : status->models()) {
      if (s.model() != model) continue;
      held = s.held_bytes();
      spare = s.spare_bytes();
      in_flight = s.in_flight_bytes();
      budget = s.budget_bytes();
    }
    std::cout << absl::StrFormat(
        "  %-15s slots %5.2f GiB (%4.2fx): model held %.2f, spare %.2f, in flight %.2f GiB, "
        "budget %.2f GiB\n",
        "", slots / gib, slots / size, held / gib, spare / gib, in_flight / gib, budget / gib);
  }
  return absl::StrFormat(" %s_rss=%d %s_own=%d %s_own_peak=%d %s_slots=%.0f", key, m->rss, key, own,
                         key, own_peak, key, slots);
}

}  // namespace

int main(int argc, char** argv) {
  std::string trainer_socket, engine_socket, model = "bench";
  int versions = 5, warmup = 1, timeout_s = 120;
  int64_t tensors = 1;
  uint64_t mib = 1024;
  double density = 0;
  std::string engine_shard = "none";
  bool memory = false;
  int burst = 0;
  std::string engine_dtype = "bf16";
  bool matrix = false;
  CLI::App app{"refit two-node benchmark: publish on one daemon, receive on another"};
  app.add_option("--trainer-socket", trainer_socket, "the trainer node's refitd socket")
      ->required();
  app.add_option("--engine-socket", engine_socket, "the engine node's refitd socket")->required();
  app.add_option("--versions", versions, "measured versions")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--warmup", warmup, "versions published first and left out of the medians")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  app.add_option("--mib", mib, "model size in MiB (bf16)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--tensors", tensors, "tensors the same bytes are split into")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{10000000}));
  app.add_option("--model", model, "model name")->capture_default_str();
  app.add_option("--density", density,
                 "fraction of elements changed per version by +-1 ulp (0: every byte changes)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--timeout", timeout_s, "seconds to wait for one version")->capture_default_str();
  app.add_option("--engine-shard", engine_shard,
                 "none: the engine holds the whole model; rows / cols: half of one 2-D tensor")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "rows", "cols"}));
  app.add_flag("--memory", memory,
               "report both daemons' resident memory after the versions (beside the model)");
  app.add_option("--burst", burst,
                 "then publish this many versions back to back (not waiting for the engine's "
                 "node between them), the engine's node taking the last")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  app.add_option("--engine", engine_dtype,
                 "bf16: the engine holds bf16 like the trainer; fp8: FP8_E4M3 with [128, 128] "
                 "block scales (2-D tensors)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp8"}));
  app.add_flag("--matrix", matrix, "2-D tensors [rows, 8192] (as --engine=fp8 uses) for bf16 too");
  CLI11_PARSE(app, argc, argv);
  const bool sharded = engine_shard != "none";
  if (sharded) tensors = 1;
  const bool fp8 = engine_dtype == "fp8";
  if (fp8 && sharded) {
    std::cerr << "two_node_bench: --engine=fp8 takes the whole model (--engine-shard=none)\n";
    return 2;
  }
  if (fp8) matrix = true;

  const uint64_t total = mib << 20;
  const int64_t elements = static_cast<int64_t>(total / 2);
  if (tensors > elements) tensors = elements;

  auto trainer = Client::Connect(trainer_socket);
  if (!trainer.ok()) return Fail("trainer node", trainer.status());
  auto engine = Client::Connect(engine_socket);
  if (!engine.ok()) return Fail("engine node", engine.status());
  (*trainer)->set_call_timeout(std::chrono::seconds(timeout_s));
  (*engine)->set_call_timeout(std::chrono::seconds(timeout_s));
  if (!WaitConnected(**engine, 1, std::chrono::seconds(20))) {
    return Fail("engine node", absl::UnavailableError("its peer (the trainer's node) never "
                                                      "connected; start it with --peers"));
  }

  const std::string tag = std::to_string(getpid());
  auto src = SharedMemory::Create("/refit-bench-trainer-" + tag, total);
  if (!src.ok()) return Fail("shared memory", src.status());
  constexpr int64_t kCols = 8192;
  const int64_t rows = static_cast<int64_t>(total / 2 / kCols);
  if (matrix && tensors > rows) tensors = rows;

  // N 1-D tensors of (nearly) equal size, back to back, in the same order on both sides; with
  // --matrix N 2-D tensors [rows_i, kCols] (the rows of one [rows, kCols] matrix split N ways).
  std::vector<v1::TensorSlice> slices;
  slices.reserve(static_cast<size_t>(tensors));
  std::vector<std::pair<int64_t, int64_t>> shapes;  // --matrix: each tensor's rows, first row
  uint64_t offset = 0;
  for (int64_t i = 0, first_row = 0; i < tensors; ++i) {
    const std::string name = absl::StrFormat("model.tensor.%07d.weight", i);
    if (matrix) {
      const int64_t r = rows / tensors + (i < rows % tensors ? 1 : 0);
      slices.push_back(Slice(name, v1::BF16, {r, kCols}, offset));
      shapes.emplace_back(r, first_row);
      first_row += r;
      offset += static_cast<uint64_t>(r * kCols) * 2;
      continue;
    }
    const int64_t n = elements / tensors + (i < elements % tensors ? 1 : 0);
    slices.push_back(Slice(name, v1::BF16, {n}, offset));
    offset += static_cast<uint64_t>(n) * 2;
  }
  std::vector<v1::TensorSlice> dst_slices = slices;
  // fp8: each tensor's e4m3 bytes back to back (the source's element order), then every scale
  // tensor, [ceil(rows_i / 128), kCols / 128] FP32 each.
  uint64_t dst_total = sharded ? total / 2 : total;
  uint64_t scales_at = 0;
  std::vector<uint64_t> scale_offset;  // fp8: of each tensor's scales in the engine's buffer
  if (fp8) {
    dst_slices.clear();
    uint64_t q_offset = 0;
    scales_at = total / 2;
    uint64_t s_offset = scales_at;
    for (size_t i = 0; i < slices.size(); ++i) {
      v1::TensorSlice d = slices[i];
      d.set_dtype(v1::FP8_E4M3);
      d.set_buffer_offset(q_offset);
      d.set_scale_tensor(slices[i].name() + "_scale_inv");
      d.add_scale_block(128);
      d.add_scale_block(128);
      const int64_t grid_rows = (shapes[i].first + 127) / 128;
      dst_slices.push_back(d);
      dst_slices.push_back(Slice(d.scale_tensor(), v1::FP32, {grid_rows, kCols / 128}, s_offset));
      scale_offset.push_back(s_offset);
      q_offset += static_cast<uint64_t>(shapes[i].first * kCols);
      s_offset += static_cast<uint64_t>(grid_rows * (kCols / 128)) * 4;
    }
    dst_total = s_offset;
  }
  auto dst = SharedMemory::Create("/refit-bench-engine-" + tag, dst_total);
  if (!dst.ok()) return Fail("shared memory", dst.status());
  if (sharded) {
    slices = {Slice("model.weight", v1::BF16, {rows, kCols}, 0)};
    dst_slices = {
        engine_shard == "rows"
            ? Slice("model.weight", v1::BF16, {rows, kCols}, 0, {0, 0}, {rows / 2, kCols})
            : Slice("model.weight", v1::BF16, {rows, kCols}, 0, {0, 0}, {rows, kCols / 2})};
  }
  // The engine's expected bytes: all of the source, or the half it holds.
  std::vector<uint8_t> expected;  // fp8: what the engine's buffer must hold
  std::vector<uint32_t> scale_row_of;
  auto matches = [&](const uint8_t* dst_bytes, const uint8_t* src_bytes) {
    if (fp8) {
      // The same quantization here, tensor by tensor, then the bytes compared.
      expected.resize(dst_total);
      uint64_t q = 0;
      for (size_t i = 0; i < slices.size(); ++i) {
        const uint64_t r = static_cast<uint64_t>(shapes[i].first);
        scale_row_of.resize(r);
        for (uint64_t k = 0; k < r; ++k) scale_row_of[k] = static_cast<uint32_t>(k / 128);
        refit::cuda::cpu::Fp8BlockRun run;
        run.src = src_bytes + slices[i].buffer_offset();
        run.src_dtype = refit::DType::kBF16;
        run.rows = r;
        run.cols = kCols;
        run.src_row_stride = kCols;
        run.block_cols = 128;
        run.scale_row_of = scale_row_of.data();
        run.scale_rows = (r + 127) / 128;
        run.dst = expected.data() + q;
        run.dst_row_stride = kCols;
        run.scales = reinterpret_cast<float*>(expected.data() + scale_offset[i]);
        run.scale_row_stride = kCols / 128;
        if (!refit::cuda::cpu::QuantizeFp8Blocks(run).ok()) return false;
        q += r * kCols;
      }
      return std::memcmp(dst_bytes, expected.data(), dst_total) == 0;
    }
    if (!sharded || engine_shard == "rows") {
      return std::memcmp(dst_bytes, src_bytes, dst_total) == 0;
    }
    const uint64_t half_row = kCols;  // bytes: kCols / 2 bf16 elements
    for (int64_t r = 0; r < rows; ++r) {
      if (std::memcmp(dst_bytes + r * half_row, src_bytes + r * 2 * half_row, half_row) != 0) {
        return false;
      }
    }
    return true;
  };
  std::string model_name = sharded        ? absl::StrCat(model, "-", engine_shard)
                           : tensors == 1 ? model
                                          : absl::StrFormat("%s-%dt", model, tensors);
  if (fp8) absl::StrAppend(&model_name, "-fp8");
  if (matrix && !fp8) absl::StrAppend(&model_name, "-2d");
  auto reg_start = Clock::now();
  auto src_id =
      (*trainer)->RegisterBuffer(model_name, v1::SOURCE, src->name(), slices, "bench-trainer");
  if (!src_id.ok()) return Fail("RegisterBuffer SOURCE", src_id.status());
  auto dst_id = (*engine)->RegisterBuffer(model_name, v1::DESTINATION, dst->name(), dst_slices,
                                          "bench-engine");
  if (!dst_id.ok()) return Fail("RegisterBuffer DESTINATION", dst_id.status());
  const double register_s = Seconds(reg_start, Clock::now());

  uint64_t base = 0;
  for (Client* c : {trainer->get(), engine->get()}) {
    auto status = c->Status();
    if (!status.ok()) continue;
    for (const auto& m : status->models()) {
      if (m.model() == model_name) base = std::max<uint64_t>(base, m.latest_version());
    }
  }

  std::cout << absl::StrFormat(
      "model %s: %d bf16 tensors%s, %d bytes (%.3f GiB); engine %s%s (%d bytes); trainer node "
      "%s -> engine node %s; register %.3f s\n",
      model_name, tensors, matrix ? absl::StrFormat(" [~%d, %d]", rows / tensors, kCols) : "",
      total, static_cast<double>(total) / (1 << 30), engine_dtype,
      fp8 ? " + [128, 128] block scales" : "", dst_total, trainer_socket, engine_socket,
      register_s);
  std::cout << absl::StrFormat("%-8s %14s %10s %10s %11s %10s %10s %10s %8s %22s\n", "version",
                               "bytes pulled", "publish s", "GB/s", "transfer s", "GB/s", "apply s",
                               "GB/s", "check", "refitd CPU s: tr / eng");
  // The daemons (found through their sockets, SO_PEERCRED): their CPU seconds per version.
  const int trainer_pid = refit::bench::SocketPeerPid(trainer_socket);
  const int engine_pid = refit::bench::SocketPeerPid(engine_socket);
  if (memory && (trainer_pid == 0 || engine_pid == 0)) {
    return Fail("--memory", absl::NotFoundError("cannot find the daemons' pids (SO_PEERCRED)"));
  }
  std::unique_ptr<RssSampler> sampler;
  if (memory) sampler = std::make_unique<RssSampler>(std::vector<int>{trainer_pid, engine_pid});
  std::vector<double> publish_s, transfer_s, apply_s, e2e_s, trainer_cpu_s, engine_cpu_s,
      pulled_bytes;
  const double gb = static_cast<double>(total) / 1e9;
  // What the engine needs, in the trainer's bf16 bytes (an fp8 engine's buffer is about half).
  const double gb_dst = static_cast<double>(sharded ? total / 2 : total) / 1e9;
  // The trainer's step that makes version `version` (the `i`th of this run) in its buffer.
  auto make_version = [&](int i, uint64_t version) {
    if (matrix && (density == 0 || i == 1)) {
      // Normal bf16 values of mixed sign and magnitude (+-2^-7 .. 2^-3), new in every element:
      // what a quantizer meets in a weight matrix (no inf/NaN, no constant blocks).
      uint64_t state = version * 0x9e3779b97f4a7c15ull;
      for (uint64_t at = 0; at + 8 <= total; at += 8) {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const uint64_t word = (z & 0x81ff81ff81ff81ffull) | 0x3c003c003c003c00ull;
        std::memcpy(src->data() + at, &word, 8);
      }
    } else if (density == 0) {
      // The "optimizer step": every byte changes; a marker per tensor.
      std::memset(src->data(), static_cast<int>(version * 37 & 0xff), total);
      for (const auto& s : slices) {
        src->data()[s.buffer_offset()] = static_cast<uint8_t>(version + s.buffer_offset() / 4096);
      }
    } else if (i == 1) {
      std::mt19937_64 rng(version);
      for (uint64_t at = 0; at + 8 <= total; at += 8) {
        const uint64_t word = rng();
        std::memcpy(src->data() + at, &word, 8);
      }
    } else {
      // An RL-like step: `density` of the bf16 elements move by one unit in the last place.
      std::mt19937_64 rng(version);
      const uint64_t n = total / 2,
                     changes = static_cast<uint64_t>(density * static_cast<double>(n));
      uint16_t* e = reinterpret_cast<uint16_t*>(src->data());
      for (uint64_t c = 0; c < changes; ++c) {
        const uint64_t r = rng();
        e[r % n] = static_cast<uint16_t>(e[r % n] + ((r >> 63) ? 1 : -1));
      }
    }
  };
  for (int i = 1; i <= warmup + versions; ++i) {
    const uint64_t version = base + static_cast<uint64_t>(i);
    const bool measured = i > warmup;
    make_version(i, version);
    const double received_before = Received(**engine);
    const double trainer_cpu0 = CpuSeconds(trainer_pid), engine_cpu0 = CpuSeconds(engine_pid);

    // The engine waits from before Publish, as an inference engine's refit loop would.
    absl::StatusOr<uint64_t> ready = absl::UnknownError("not waited");
    Clock::time_point t_ready;
    std::thread waiter([&] {
      ready = (*engine)->WaitForVersion(model_name, version, std::chrono::seconds(timeout_s));
      t_ready = Clock::now();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the wait be in place
    const auto t0 = Clock::now();
    auto published = (*trainer)->Publish(model_name, version, {*src_id});
    const auto t1 = Clock::now();
    waiter.join();
    if (!published.ok()) return Fail("Publish", published.status());
    if (!ready.ok()) return Fail(absl::StrFormat("WaitForVersion %d", version), ready.status());

    const auto t2 = Clock::now();
    auto applied = (*engine)->Apply(model_name, version, {*dst_id});
    const auto t3 = Clock::now();
    if (!applied.ok()) return Fail("Apply", applied.status());
    // Publish -> complete -> Apply: the daemons' CPU over the version (before the check).
    const double trainer_cpu = CpuSeconds(trainer_pid) - trainer_cpu0;
    const double engine_cpu = CpuSeconds(engine_pid) - engine_cpu0;
    const bool ok = matches(dst->data(), src->data());
    const double pulled = Received(**engine) - received_before;

    const double pub = Seconds(t0, t1), xfer = Seconds(t1, t_ready), app_s = Seconds(t2, t3);
    std::cout << absl::StrFormat(
        "%-8s %14.0f %10.4f %10.2f %11.4f %10.2f %10.4f %10.2f %8s %11.3f / %7.3f\n",
        absl::StrCat(version, measured ? "" : " (w)"), pulled, pub, gb / pub, xfer, gb_dst / xfer,
        app_s, gb_dst / app_s, ok ? "ok" : "WRONG", trainer_cpu, engine_cpu);
    if (!ok) return 1;
    if (measured) {
      publish_s.push_back(pub);
      transfer_s.push_back(xfer);
      apply_s.push_back(app_s);
      e2e_s.push_back(Seconds(t0, t_ready));
      trainer_cpu_s.push_back(trainer_cpu);
      engine_cpu_s.push_back(engine_cpu);
      pulled_bytes.push_back(pulled);
    }
  }

  const double publish_gbs = gb / Median(publish_s), transfer_gbs = gb_dst / Median(transfer_s),
               apply_gbs = gb_dst / Median(apply_s), e2e_gbs = gb_dst / Median(e2e_s);
  std::cout << absl::StrFormat(
      "medians over %d versions of %.3f GB, %d tensors ((w) = warm-up, not counted):\n"
      "  publish   %8.4f s  %7.2f GB/s\n"
      "  transfer  %8.4f s  %7.2f GB/s   (Publish returned -> WaitForVersion returned)\n"
      "  apply     %8.4f s  %7.2f GB/s\n"
      "  publish+transfer %.4f s  %7.2f GB/s\n"
      "  refitd CPU per version (publish -> complete -> Apply): trainer's node %.3f s, engine's "
      "node %.3f s\n",
      versions, gb, tensors, Median(publish_s), publish_gbs, Median(transfer_s), transfer_gbs,
      Median(apply_s), apply_gbs, Median(e2e_s), e2e_gbs, Median(trainer_cpu_s),
      Median(engine_cpu_s));
  if (sharded) {
    std::cout << absl::StrFormat(
        "  (engine shard %s: transfer and apply GB/s over the %.3f GB the engine holds)\n",
        engine_shard, gb_dst);
  }
  if (burst > 0) {
    // The trainer publishes `burst` versions back to back, faster than the engine's node takes
    // them (it skips to the newest); then the engine's node takes the last one.
    const int first = warmup + versions + 1;
    uint64_t last = 0;
    for (int i = first; i < first + burst; ++i) {
      last = base + static_cast<uint64_t>(i);
      make_version(i, last);
      auto published = (*trainer)->Publish(model_name, last, {*src_id});
      if (!published.ok()) return Fail("Publish (burst)", published.status());
    }
    auto ready = (*engine)->WaitForVersion(model_name, last, std::chrono::seconds(timeout_s));
    if (!ready.ok()) return Fail("WaitForVersion (burst)", ready.status());
    auto applied = (*engine)->Apply(model_name, last, {*dst_id});
    if (!applied.ok()) return Fail("Apply (burst)", applied.status());
    if (!matches(dst->data(), src->data())) {
      std::cerr << "two_node_bench: version " << last << " (burst) arrived WRONG\n";
      return 1;
    }
    // Readers' pins and the delta encoder let go of the versions in between.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::cout << absl::StrFormat(
        "burst: %d versions published back to back; the engine's node "
        "took version %d\n",
        burst, last);
  }
  std::string memory_fields;
  if (sampler) {
    const std::vector<uint64_t> peak = sampler->Stop();
    std::cout << absl::StrFormat("memory after %d versions of a %.3f GiB model:\n",
                                 warmup + versions + burst, static_cast<double>(total) / (1 << 30));
    memory_fields += ReportMemory("trainer's node", "trainer", trainer_pid, peak[0], **trainer,
                                  model_name, total);
    memory_fields +=
        ReportMemory("engine's node", "engine", engine_pid, peak[1], **engine, model_name, total);
  }
  std::cout << absl::StrFormat(
      "RESULT engine=%s shard=%s density=%g tensors=%d bytes=%d versions=%d burst=%d "
      "register_s=%.6f publish_s=%.6f "
      "transfer_s=%.6f "
      "apply_s=%.6f "
      "e2e_s=%.6f transfer_gbs=%.4f apply_gbs=%.4f publish_gbs=%.4f trainer_cpu_s=%.4f "
      "engine_cpu_s=%.4f pulled_bytes=%.0f%s\n",
      engine_dtype, engine_shard, density, tensors, total, versions, burst, register_s,
      Median(publish_s), Median(transfer_s), Median(apply_s), Median(e2e_s), transfer_gbs,
      apply_gbs, publish_gbs, Median(trainer_cpu_s), Median(engine_cpu_s), Median(pulled_bytes),
      memory_fields);
  (void)(*engine)->ReleaseBuffer(*dst_id);
  (void)(*trainer)->ReleaseBuffer(*src_id);
  return 0;
}
