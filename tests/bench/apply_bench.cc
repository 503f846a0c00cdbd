// apply_bench: the install on an engine's node (issue 32): sparse Apply of an RL-like step
// beside a full Apply of the same version and beside memcpy of the model, in one run.
//
// Given two running refitd — the trainer's node and the engine's node (--peers=<the trainer's
// --listen>) — it registers a bf16 model (--mib, in tensors of 32 MiB) as SOURCE on the trainer's
// node and two DESTINATION buffers of the same layout on the engine's node: "sparse", which
// gets every version (so it holds N-1 when N arrives: sparse Apply), and "full", registered
// afresh before each version (it holds nothing known: the full, undo-journaled copy). Versions: the
// first random, then steps of --density (that fraction of the elements moves by one bf16 ulp,
// the demo's generator), or with --real=DIR the real successive versions of
// ../shared/data/deltas/<model>, tiled over the model's bytes (their own change pattern). Every
// Apply is checked byte for byte. Per version: the changed share, Apply seconds and bytes
// written (refit_apply_bytes_total) of both, undo bytes, and memcpy of the model in this run.
// --fp8: the engine's buffers are FP8_E4M3 with [128, 128] block scales (each weight's FP32
// `weight_scale_inv` beside it), quantized on the engine's node; the sparse buffer is checked
// against the full one byte for byte, and memcpy is of the fp8 buffer's bytes.
//
// --generate-ms: the engine "generates" that long between the version's completion and its
// Apply, as an RL engine does (the engine's refitd prepares the sparse Apply meanwhile: the
// "prep" column says whether the Apply found it, refit_apply_sparse_prepared_total).
//
//   apply_bench --trainer-socket=A.sock --engine-socket=B.sock [--mib=1024] [--versions=6]
//               [--density=0.004] [--real=DIR] [--fp8] [--generate-ms=0]

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "client/refit_client.h"
#include "tests/bench/bench_util.h"

namespace {

namespace v1 = refit::v1;
using refit::bench::Clock;
using refit::bench::CpuSeconds;
using refit::bench::Median;
using refit::bench::Metric;
using refit::bench::Seconds;
using refit::bench::WaitConnected;
using refit::client::Client;
using refit::client::SharedMemory;
using refit::client::Slice;

int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "apply_bench: " << what << ": " << status.ToString() << "\n";
  return 1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// `block` repeated over [0, n).
void Tile(uint8_t* to, uint64_t n, const std::string& block) {
  for (uint64_t at = 0; at < n; at += block.size()) {
    std::memcpy(to + at, block.data(), std::min<uint64_t>(block.size(), n - at));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparse Apply vs full Apply vs memcpy on an engine's node"};
  std::string trainer_socket, engine_socket, real;
  uint64_t mib = 1024;
  int versions = 6;
  double density = 0.004;
  int engine_pid = 0;
  int generate_ms = 0;
  bool fp8 = false;
  app.add_option("--trainer-socket", trainer_socket)->required();
  app.add_option("--engine-socket", engine_socket)->required();
  app.add_option("--mib", mib);
  app.add_option("--versions", versions);
  app.add_option("--density", density);
  app.add_option("--real", real, "a folder of ../shared/data/deltas (v000.bin ...)");
  app.add_option("--engine-pid", engine_pid, "the engine node's refitd: its CPU time per Apply");
  app.add_flag("--fp8", fp8, "fp8 destinations with [128, 128] block scales");
  app.add_option("--generate-ms", generate_ms,
                 "the engine generates this long between a version's completion and its Apply");
  CLI11_PARSE(app, argc, argv);

  auto trainer = Client::Connect(trainer_socket);
  auto engine = Client::Connect(engine_socket);
  if (!trainer.ok()) return Fail("trainer", trainer.status());
  if (!engine.ok()) return Fail("engine", engine.status());
  if (!WaitConnected(**engine, 1, std::chrono::seconds(10))) {
    return Fail("engine", absl::UnavailableError("its peer did not connect"));
  }
  const int64_t rows = 4096, cols = 4096;  // 32 MiB bf16 tensors
  const uint64_t tensor_bytes = rows * cols * 2;
  const int tensors = static_cast<int>(std::max<uint64_t>(1, (mib << 20) / tensor_bytes));
  const uint64_t total = tensor_bytes * static_cast<uint64_t>(tensors);
  std::vector<v1::TensorSlice> layout;
  for (int t = 0; t < tensors; ++t) {
    layout.push_back(Slice("layers." + std::to_string(t) + ".weight", v1::BF16, {rows, cols},
                           static_cast<uint64_t>(t) * tensor_bytes));
  }
  // The engine's layout: the same, or with --fp8 each weight in fp8 and its scales after it.
  const int64_t grid = rows / 128;
  const uint64_t fp8_stride = rows * cols + grid * grid * 4;
  const uint64_t total_dst = fp8 ? fp8_stride * static_cast<uint64_t>(tensors) : total;
  std::vector<v1::TensorSlice> dst_layout = layout;
  if (fp8) {
    dst_layout.clear();
    for (int t = 0; t < tensors; ++t) {
      const std::string name = "layers." + std::to_string(t) + ".weight";
      v1::TensorSlice q =
          Slice(name, v1::FP8_E4M3, {rows, cols}, static_cast<uint64_t>(t) * fp8_stride);
      q.set_scale_tensor(name + "_scale_inv");
      q.add_scale_block(128);
      q.add_scale_block(128);
      dst_layout.push_back(q);
      dst_layout.push_back(Slice(name + "_scale_inv", v1::FP32, {grid, grid},
                                 static_cast<uint64_t>(t) * fp8_stride + rows * cols));
    }
  }
  auto make = [&](const std::string& tag, uint64_t bytes) {
    return SharedMemory::Create("/refit-apply-bench-" + tag + "-" + std::to_string(getpid()),
                                bytes);
  };
  auto src_or = make("src", total);
  auto sparse_or = make("sparse", total_dst);
  auto full_or = make("full", total_dst);
  for (auto* m : {&src_or, &sparse_or, &full_or}) {
    if (!m->ok()) return Fail("shared memory", m->status());
  }
  SharedMemory* src = &*src_or;
  SharedMemory* sparse = &*sparse_or;
  SharedMemory* full = &*full_or;
  const std::string model = "apply-bench";
  auto src_id = (*trainer)->RegisterBuffer(model, v1::SOURCE, *src, layout, "trainer");
  if (!src_id.ok()) return Fail("register source", src_id.status());
  std::memset(sparse->data(), 0, total_dst);
  std::memset(full->data(), 0, total_dst);
  auto sparse_id = (*engine)->RegisterBuffer(model, v1::DESTINATION, *sparse, dst_layout, "engine");
  if (!sparse_id.ok()) return Fail("register destination", sparse_id.status());
  std::string full_id;

  std::vector<std::string> real_versions;
  if (!real.empty()) {
    for (int v = 0; v < 10; ++v) {
      const std::string bytes = ReadFile(absl::StrFormat("%s/v%03d.bin", real, v));
      if (bytes.empty()) break;
      real_versions.push_back(bytes);
    }
    if (real_versions.size() < 2) return Fail("--real", absl::NotFoundError(real));
    versions = static_cast<int>(real_versions.size());
  }
  std::mt19937_64 rng(7);
  auto received = [&] { return Metric(**engine, "refit_data_bytes_received_total").value_or(0); };
  auto apply_bytes = [&] { return Metric(**engine, "refit_apply_bytes_total").value_or(0); };
  auto undo_bytes = [&] { return Metric(**engine, "refit_apply_undo_bytes_total").value_or(0); };
  auto prepared = [&] { return Metric(**engine, "refit_apply_sparse_prepared_total").value_or(0); };

  std::cout << absl::StrFormat(
      "model: %d bf16 tensors [%d, %d], %.3f GiB; engine: 2 DESTINATION buffers, %s\n", tensors,
      rows, cols, static_cast<double>(total) / (1 << 30),
      fp8 ? absl::StrFormat("fp8 + [128, 128] block scales, %.3f GiB",
                            static_cast<double>(total_dst) / (1 << 30))
          : std::string("same layout"));
  std::cout << absl::StrFormat("%-4s %9s %12s %10s %14s %12s %10s %14s %12s %8s %8s %5s %4s\n",
                               "ver", "changed", "on the wire", "sparse s", "sparse bytes",
                               "undo bytes", "full s", "full bytes", "undo bytes", "sp/full",
                               "full/cpy", "check", "prep");
  int prepared_applies = 0, sparse_applies = 0;
  std::vector<double> ratio, sparse_s, full_s, sparse_written;
  std::vector<double> copy, sparse_cpu, full_cpu, complete;
  for (int i = 0; i < versions; ++i) {
    const uint64_t version = static_cast<uint64_t>(i) + 1;
    uint64_t changed = total / 2;
    if (!real_versions.empty()) {
      if (i > 0) {  // the real step's share, over its own bytes
        const std::string& a = real_versions[static_cast<size_t>(i)];
        const std::string& b = real_versions[static_cast<size_t>(i) - 1];
        uint64_t c = 0;
        for (size_t e = 0; e + 1 < a.size(); e += 2) c += a[e] != b[e] || a[e + 1] != b[e + 1];
        changed = static_cast<uint64_t>(static_cast<double>(c) / static_cast<double>(a.size() / 2) *
                                        static_cast<double>(total / 2));
      }
      Tile(src->data(), total, real_versions[static_cast<size_t>(i)]);
    } else if (i == 0) {
      for (uint64_t at = 0; at + 8 <= total; at += 8) {
        const uint64_t word = rng() & 0x3f3f3f3f3f3f3f3full;  // finite bf16 values
        std::memcpy(src->data() + at, &word, 8);
      }
    } else {
      uint16_t* w = reinterpret_cast<uint16_t*>(src->data());
      const uint64_t n = total / 2;
      changed = static_cast<uint64_t>(density * static_cast<double>(n));  // a few coincide
      for (uint64_t c = 0; c < changed; ++c) {
        const uint64_t r = rng();
        w[r % n] = static_cast<uint16_t>(w[r % n] + ((r >> 63) ? 1 : -1));
      }
    }
    // The full buffer: memcpy of the model into it (the reference, this run), then registered
    // afresh, so that it holds no known version.
    // (--fp8: of the fp8 buffer's bytes, from the sparse buffer.)
    auto m0 = Clock::now();
    std::memcpy(full->data(), fp8 ? sparse->data() : src->data(), total_dst);
    const double copy_s = Seconds(m0, Clock::now());
    copy.push_back(copy_s);
    std::memset(full->data(), 0, total_dst);
    if (!full_id.empty()) (void)(*engine)->ReleaseBuffer(full_id);
    auto fid = (*engine)->RegisterBuffer(model, v1::DESTINATION, *full, dst_layout, "engine-full");
    if (!fid.ok()) return Fail("register destination", fid.status());
    full_id = *fid;
    const double wire_before = received();
    auto published = (*trainer)->Publish(model, version, {*src_id});
    if (!published.ok()) return Fail("publish", published.status());
    // Publish returned -> complete on the engine's node (pulled, verified, diffed for the
    // sparse Apply), and the engine refitd's CPU seconds meanwhile.
    const double pc0 = CpuSeconds(engine_pid);
    auto p0 = Clock::now();
    auto ready = (*engine)->WaitForVersion(model, version, std::chrono::milliseconds(120000));
    if (!ready.ok()) return Fail("wait", ready.status());
    const double complete_s = Seconds(p0, Clock::now());
    const double complete_cpu = CpuSeconds(engine_pid) - pc0;
    const double wire = received() - wire_before;
    // The engine generates meanwhile (its refitd prepares the sparse Apply).
    std::this_thread::sleep_for(std::chrono::milliseconds(generate_ms));
    const double prepared_before = prepared();

    const double ab0 = apply_bytes(), ub0 = undo_bytes();
    const double c0 = CpuSeconds(engine_pid);
    auto t0 = Clock::now();
    auto a = (*engine)->Apply(model, version, {*sparse_id});
    auto t1 = Clock::now();
    const double c1 = CpuSeconds(engine_pid);
    if (!a.ok()) return Fail("sparse apply", a.status());
    const double ab1 = apply_bytes(), ub1 = undo_bytes();
    const bool was_prepared = prepared() > prepared_before;
    const double c2 = CpuSeconds(engine_pid);
    auto t2 = Clock::now();
    auto b = (*engine)->Apply(model, version, {full_id});
    auto t3 = Clock::now();
    const double c3 = CpuSeconds(engine_pid);
    if (!b.ok()) return Fail("full apply", b.status());
    const double ab2 = apply_bytes(), ub2 = undo_bytes();
    const bool ok = fp8 ? std::memcmp(sparse->data(), full->data(), total_dst) == 0
                        : std::memcmp(sparse->data(), src->data(), total) == 0 &&
                              std::memcmp(full->data(), src->data(), total) == 0;
    const double s = Seconds(t0, t1), f = Seconds(t2, t3);
    std::cout << absl::StrFormat(
        "%-4d %8.3f%% %12.0f %10.4f %14.0f %12.0f %10.4f %14.0f %12.0f %8.3f %8.2f %5s %4s\n",
        version, 100.0 * static_cast<double>(changed) / static_cast<double>(total / 2), wire, s,
        ab1 - ab0, ub1 - ub0, f, ab2 - ab1, ub2 - ub1, s / f, f / copy_s, ok ? "ok" : "WRONG",
        was_prepared ? "yes" : "no");
    if (!ok) return 1;
    if (engine_pid > 0) {
      std::cout << absl::StrFormat(
          "     refitd CPU s: sparse %.3f, full %.3f; publish -> complete %.4f s (engine refitd "
          "CPU %.3f s)\n",
          c1 - c0, c3 - c2, complete_s, complete_cpu);
    }
    if (i >= 2) {  // after the first versions (full everywhere, slots being allocated)
      ++sparse_applies;
      prepared_applies += was_prepared ? 1 : 0;
      sparse_cpu.push_back(c1 - c0);
      full_cpu.push_back(c3 - c2);
      ratio.push_back(s / f);
      sparse_s.push_back(s);
      full_s.push_back(f);
      sparse_written.push_back(ab1 - ab0);
      complete.push_back(complete_s);
    }
  }
  if (!ratio.empty()) {
    std::cout << absl::StrFormat(
        "\nmedians over versions 3..%d of %.3f GB (engine's buffer):\n"
        "  memcpy of the model   %.4f s (reference, same run)\n"
        "  full Apply            %.4f s = %.2fx memcpy\n"
        "  sparse Apply          %.4f s = %.3fx full Apply, %.3fx memcpy; %.0f bytes written "
        "(%.4f%% of the model)\n",
        versions, static_cast<double>(total_dst) / 1e9, Median(copy), Median(full_s),
        Median(full_s) / Median(copy), Median(sparse_s), Median(ratio),
        Median(sparse_s) / Median(copy), Median(sparse_written),
        100.0 * Median(sparse_written) / static_cast<double>(total_dst));
    if (engine_pid > 0) {
      std::cout << absl::StrFormat(
          "  refitd CPU seconds    sparse %.3f, full %.3f: sparse = %.3fx full (10 ms ticks)\n",
          Median(sparse_cpu), Median(full_cpu), Median(sparse_cpu) / Median(full_cpu));
    }
    std::cout << absl::StrFormat(
        "  publish -> complete   %.4f s on the engine's node (pull, verify, diff)\n",
        Median(complete));
    std::cout << absl::StrFormat(
        "  prepared              %d of %d sparse Applies found their writes collected as the "
        "version completed (the engine generated %d ms before each Apply)\n",
        prepared_applies, sparse_applies, generate_ms);
    std::cout << absl::StrFormat(
        "RESULT sparse_over_full=%.4f full_over_memcpy=%.3f sparse_over_memcpy=%.4f\n",
        Median(ratio), Median(full_s) / Median(copy), Median(sparse_s) / Median(copy));
  }
  (void)(*trainer)->ReleaseBuffer(*src_id);
  (void)(*engine)->ReleaseBuffer(*sparse_id);
  (void)(*engine)->ReleaseBuffer(full_id);
  return 0;
}
