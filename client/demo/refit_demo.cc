// refit_demo: a synthetic trainer and an inference engine on one node, talking to a real
// refitd. The trainer publishes versions of a Llama-shaped bf16 model (~1 GiB by default); the
// engine, whose layout fuses q/k/v and gate/up the way inference engines do, waits for each
// version and applies it. Per version it prints bytes, seconds and GB/s of Publish and Apply,
// and at the end the medians next to a plain memcpy of the same bytes measured in this run.
//
//   refit_demo --socket=/tmp/refit/refitd.sock [--versions=5] [--layers=8] [--hidden=2048]
//   refit_demo --socket=A.sock --engine-socket=B.sock   (two daemons acting as two nodes: the
//              "wait" column is then Publish returning on A -> the version complete on B)
//
// Each version after the first is an RL-like step (--density=0.004: that fraction of the bf16
// weights moves by one unit in the last place), so between two daemons the "on the wire" column
// shows delta sync at work; --density=0 changes every byte instead. The engine checks every
// tensor byte for byte after each Apply.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "client/refit_client.h"

namespace {

namespace v1 = refit::v1;
using refit::client::Client;
using refit::client::SharedMemory;
using refit::client::Slice;
using Clock = std::chrono::steady_clock;

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t Bytes() const {
    uint64_t n = 2;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};

// Hugging Face Llama names. The trainer keeps them in this order; the engine fuses them.
std::vector<Tensor> LlamaTensors(int layers, int64_t hidden, int64_t vocab) {
  const int64_t inter = hidden * 11 / 4;
  std::vector<Tensor> t{{"model.embed_tokens.weight", {vocab, hidden}}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n :
         {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}) {
      t.push_back({p + n + ".weight", {hidden, hidden}});
    }
    t.push_back({p + "mlp.gate_proj.weight", {inter, hidden}});
    t.push_back({p + "mlp.up_proj.weight", {inter, hidden}});
    t.push_back({p + "mlp.down_proj.weight", {hidden, inter}});
    t.push_back({p + "input_layernorm.weight", {hidden}});
    t.push_back({p + "post_attention_layernorm.weight", {hidden}});
  }
  t.push_back({"model.norm.weight", {hidden}});
  t.push_back({"lm_head.weight", {vocab, hidden}});
  return t;
}

// The engine's order: per layer qkv_proj = [q; k; v] and gate_up_proj = [gate; up], adjacent.
std::vector<const Tensor*> EngineOrder(const std::vector<Tensor>& tensors) {
  std::vector<const Tensor*> order;
  for (const Tensor& t : tensors) order.push_back(&t);
  auto rank = [](const std::string& name) {
    for (auto [key, r] :
         std::vector<std::pair<const char*, int>>{{"q_proj", 0},
                                                  {"k_proj", 1},
                                                  {"v_proj", 2},
                                                  {"o_proj", 3},
                                                  {"gate_proj", 4},
                                                  {"up_proj", 5},
                                                  {"down_proj", 6},
                                                  {"input_layernorm", 7},
                                                  {"post_attention_layernorm", 8}}) {
      if (name.find(key) != std::string::npos) return r;
    }
    return 9;
  };
  std::stable_sort(order.begin(), order.end(), [&](const Tensor* a, const Tensor* b) {
    auto layer = [](const std::string& n) {
      auto p = n.find("layers.");
      return p == std::string::npos ? -1 : std::stoi(n.substr(p + 7));
    };
    if (layer(a->name) != layer(b->name)) return layer(a->name) < layer(b->name);
    return rank(a->name) < rank(b->name);
  });
  return order;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;  // even: the middle two's mean
}

int Fail(const absl::Status& status) {
  std::cerr << "refit_demo: " << status.message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket = refit::client::DefaultSocketPath();
  std::string engine_socket;
  int versions = 5, layers = 8;
  int64_t hidden = 2048, vocab = 32000;
  CLI::App app{"refit demo: a synthetic trainer publishes, an inference engine applies"};
  app.add_option("--socket", socket, "the trainer node's refitd socket");
  app.add_option("--engine-socket", engine_socket,
                 "the engine node's refitd socket (default: the trainer's)");
  bool named_shm = false;
  app.add_flag("--named-shm", named_shm,
               "lend named POSIX shm objects instead of sealed memfds (the default)");
  app.add_option("--versions", versions, "versions to publish")->capture_default_str();
  app.add_option("--layers", layers, "transformer layers")->capture_default_str();
  app.add_option("--hidden", hidden, "hidden size")->capture_default_str();
  app.add_option("--vocab", vocab, "vocabulary size")->capture_default_str();
  double density = 0.004;
  app.add_option("--density", density,
                 "an RL-like step: this fraction of the weights moves by one bf16 ulp per version "
                 "(0: every byte changes)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);

  const std::vector<Tensor> tensors = LlamaTensors(layers, hidden, vocab);
  uint64_t total = 0;
  for (const Tensor& t : tensors) total += t.Bytes();

  auto trainer = Client::Connect(socket);
  if (!trainer.ok()) return Fail(trainer.status());
  if (engine_socket.empty()) engine_socket = socket;
  auto engine = Client::Connect(engine_socket);
  if (!engine.ok()) return Fail(engine.status());
  const std::string tag = std::to_string(getpid());
  auto src = named_shm ? SharedMemory::Create("/refit-demo-trainer-" + tag, total)
                       : SharedMemory::CreateSealed(total, "refit-demo-trainer");
  if (!src.ok()) return Fail(src.status());
  auto dst = named_shm ? SharedMemory::Create("/refit-demo-engine-" + tag, total)
                       : SharedMemory::CreateSealed(total, "refit-demo-engine");
  if (!dst.ok()) return Fail(dst.status());

  std::vector<v1::TensorSlice> src_slices, dst_slices;
  uint64_t offset = 0;
  std::map<std::string, uint64_t> src_offset;
  for (const Tensor& t : tensors) {
    src_slices.push_back(Slice(t.name, v1::BF16, t.shape, offset));
    src_offset[t.name] = offset;
    offset += t.Bytes();
  }
  offset = 0;
  std::map<std::string, uint64_t> dst_offset;
  for (const Tensor* t : EngineOrder(tensors)) {
    dst_slices.push_back(Slice(t->name, v1::BF16, t->shape, offset));
    dst_offset[t->name] = offset;
    offset += t->Bytes();
  }
  const std::string model = "demo-llama";
  auto src_id = (*trainer)->RegisterBuffer(model, v1::SOURCE, *src, src_slices, "demo-trainer");
  if (!src_id.ok()) return Fail(src_id.status());
  auto dst_id = (*engine)->RegisterBuffer(model, v1::DESTINATION, *dst, dst_slices, "demo-engine");
  if (!dst_id.ok()) return Fail(dst_id.status());

  std::cout << absl::StrFormat(
      "model %s: %d tensors, %.3f GiB bf16; trainer layout -> engine layout (fused qkv, "
      "gate_up)\n",
      model, tensors.size(), static_cast<double>(total) / (1 << 30));
  const bool two_nodes = engine_socket != socket;
  std::cout << absl::StrFormat(
      "%-8s %14s %14s %10s %8s %10s %8s %10s %8s %6s\n", "version", "bytes", "on the wire",
      "publish s", "GB/s", two_nodes ? "transfer s" : "wait s", "GB/s", "apply s", "GB/s", "check");
  auto received = [&]() -> double {
    auto status = (*engine)->Status();
    if (!status.ok()) return 0;
    auto it = status->metrics().find("refit_data_bytes_received_total");
    return it == status->metrics().end() ? 0 : it->second;
  };
  std::mt19937_64 rng(42);
  std::vector<double> publish_s, apply_s, transfer_s;
  uint64_t base = 0;
  {
    auto status = (*trainer)->Status();
    if (status.ok()) {
      for (const auto& m : status->models()) {
        if (m.model() == model) base = m.latest_version();
      }
    }
  }
  for (int i = 1; i <= versions; ++i) {
    const uint64_t version = base + static_cast<uint64_t>(i);
    if (density == 0) {
      // The "optimizer step": every weight changes; a pattern derived from the version lets
      // the engine check what it got.
      std::memset(src->data(), static_cast<int>(version & 0xff), total);
      for (const Tensor& t : tensors) {
        src->data()[src_offset[t.name]] = static_cast<uint8_t>(t.shape[0] + version);
      }
    } else if (i == 1) {
      for (uint64_t at = 0; at + 8 <= total; at += 8) {  // the initial weights
        const uint64_t word = rng();
        std::memcpy(src->data() + at, &word, 8);
      }
    } else {
      // An RL fine-tuning step in bf16: a few weights move by one unit in the last place.
      uint16_t* w = reinterpret_cast<uint16_t*>(src->data());
      const uint64_t n = total / 2;
      for (uint64_t c = 0; c < static_cast<uint64_t>(density * static_cast<double>(n)); ++c) {
        const uint64_t r = rng();
        w[r % n] = static_cast<uint16_t>(w[r % n] + ((r >> 63) ? 1 : -1));
      }
    }
    const double received_before = two_nodes ? received() : 0;

    const auto t0 = Clock::now();
    auto published = (*trainer)->Publish(model, version, {*src_id});
    const auto t1 = Clock::now();
    if (!published.ok()) return Fail(published.status());

    auto ready = (*engine)->WaitForVersion(model, version, std::chrono::seconds(60));
    if (!ready.ok()) return Fail(ready.status());
    const auto t2 = Clock::now();
    auto applied = (*engine)->Apply(model, version, {*dst_id});
    const auto t3 = Clock::now();
    if (!applied.ok()) return Fail(applied.status());
    const double wire = two_nodes ? received() - received_before : 0;
    bool ok = true;  // every tensor, byte for byte, in the engine's (fused) layout
    for (const Tensor& t : tensors) {
      ok = ok && std::memcmp(dst->data() + dst_offset[t.name], src->data() + src_offset[t.name],
                             t.Bytes()) == 0;
    }
    if (density == 0) {
      std::memset(src->data(), 0, total);  // the trainer's next step: the version stays intact
    }
    publish_s.push_back(Seconds(t0, t1));
    transfer_s.push_back(Seconds(t1, t2));
    apply_s.push_back(Seconds(t2, t3));
    std::cout << absl::StrFormat(
        "%-8d %14d %14.0f %10.4f %8.2f %10.4f %8.2f %10.4f %8.2f %6s\n", version,
        published->bytes(), wire, publish_s.back(), published->bytes() / publish_s.back() / 1e9,
        transfer_s.back(), two_nodes ? total / transfer_s.back() / 1e9 : 0.0, apply_s.back(),
        applied->bytes_written() / apply_s.back() / 1e9, ok ? "ok" : "WRONG");
    if (!ok) return 1;
  }

  // Reference: memcpy of the same bytes between two already-touched buffers, this run.
  std::vector<double> memcpy_s;
  for (int i = 0; i < std::max(3, versions); ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst->data(), src->data(), total);
    memcpy_s.push_back(Seconds(t0, Clock::now()));
  }
  const double gb = static_cast<double>(total) / 1e9;
  const double memcpy_gbs = gb / Median(memcpy_s);
  const double publish_gbs = gb / Median(publish_s);
  const double apply_gbs = gb / Median(apply_s);
  std::cout << absl::StrFormat(
      "\nmedians over %d versions of %.3f GB:\n"
      "  memcpy  %7.2f GB/s  (reference, same bytes, same run)\n"
      "  publish %7.2f GB/s  = %.2fx memcpy\n"
      "  apply   %7.2f GB/s  = %.2fx memcpy\n",
      versions, gb, memcpy_gbs, publish_gbs, publish_gbs / memcpy_gbs, apply_gbs,
      apply_gbs / memcpy_gbs);
  if (two_nodes) {
    std::cout << absl::StrFormat(
        "  publish -> complete on the engine's node: %.3f s median, %.2f GB/s\n",
        Median(transfer_s), gb / Median(transfer_s));
    if (transfer_s.size() > 3) {
      // The first versions also allocate the engine's staging slots (--retain + 1 of them).
      const std::vector<double> steady(transfer_s.begin() + 3, transfer_s.end());
      std::cout << absl::StrFormat(
          "  publish -> complete, versions after the first 3: %.3f s median (%.2f GB of "
          "weights/s)\n",
          Median(steady), gb / Median(steady));
    }
  }
  (void)(*trainer)->ReleaseBuffer(*src_id);
  (void)(*engine)->ReleaseBuffer(*dst_id);
  return 0;
}
