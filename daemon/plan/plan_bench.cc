// Plans a 70B-shaped (Llama-3-70B) reshard from TP8 trainer buffers to TP2 inference buffers and
// prints the median planning time, the op count and src_bytes over the bytes the destinations
// need, for single-row and multi-row ops. Usage: plan_bench [repetitions]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/common/types.h"
#include "daemon/plan/plan.h"

namespace refit::plan {
namespace {

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int split_dim;  // -1: replicated on every rank
};

std::vector<Tensor> Llama70B() {
  const int64_t hidden = 8192;
  const int64_t ffn = 28672;
  const int64_t kv = 1024;
  const int64_t vocab = 128256;
  std::vector<Tensor> model{{"model.embed_tokens.weight", {vocab, hidden}, 0}};
  for (int layer = 0; layer < 80; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    model.push_back({p + "self_attn.q_proj.weight", {hidden, hidden}, 0});
    model.push_back({p + "self_attn.k_proj.weight", {kv, hidden}, 0});
    model.push_back({p + "self_attn.v_proj.weight", {kv, hidden}, 0});
    model.push_back({p + "self_attn.o_proj.weight", {hidden, hidden}, 1});
    model.push_back({p + "mlp.gate_proj.weight", {ffn, hidden}, 0});
    model.push_back({p + "mlp.up_proj.weight", {ffn, hidden}, 0});
    model.push_back({p + "mlp.down_proj.weight", {hidden, ffn}, 1});
    model.push_back({p + "input_layernorm.weight", {hidden}, -1});
    model.push_back({p + "post_attention_layernorm.weight", {hidden}, -1});
  }
  model.push_back({"model.norm.weight", {hidden}, -1});
  model.push_back({"lm_head.weight", {vocab, hidden}, 0});
  return model;
}

// One buffer per rank, tensors packed in model order (so q, k, v and gate, up are adjacent).
std::vector<std::vector<TensorSlice>> Layout(const std::vector<Tensor>& model, int degree,
                                             std::vector<uint64_t>* sizes) {
  std::vector<std::vector<TensorSlice>> buffers(degree);
  sizes->assign(degree, 0);
  for (int rank = 0; rank < degree; ++rank) {
    uint64_t offset = 0;
    for (const Tensor& t : model) {
      TensorSlice s;
      s.name = t.name;
      s.dtype = DType::kBF16;
      s.global_shape = t.shape;
      s.offsets.assign(t.shape.size(), 0);
      s.sizes = t.shape;
      if (t.split_dim >= 0) {
        const int64_t part = t.shape[t.split_dim] / degree;
        s.offsets[t.split_dim] = rank * part;
        s.sizes[t.split_dim] = part;
      }
      s.buffer_offset = offset;
      offset += s.NumElements() * 2;
      buffers[rank].push_back(std::move(s));
    }
    (*sizes)[rank] = offset;
  }
  return buffers;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run(int repetitions) {
  const std::vector<Tensor> model = Llama70B();
  std::vector<uint64_t> src_sizes;
  std::vector<uint64_t> dst_sizes;
  auto src_buffers = Layout(model, 8, &src_sizes);
  auto dst_buffers = Layout(model, 2, &dst_sizes);
  using Clock = std::chrono::steady_clock;
  const auto v0 = Clock::now();
  for (size_t i = 0; i < src_buffers.size(); ++i) {
    if (!NormalizeAndValidateBuffer(src_buffers[i], src_sizes[i]).ok()) return 1;
  }
  for (size_t i = 0; i < dst_buffers.size(); ++i) {
    if (!NormalizeAndValidateBuffer(dst_buffers[i], dst_sizes[i]).ok()) return 1;
  }
  const double validate_ms = std::chrono::duration<double, std::milli>(Clock::now() - v0).count();
  std::vector<PlacedSlice> sources;
  for (size_t i = 0; i < src_buffers.size(); ++i) {
    for (const TensorSlice& s : src_buffers[i]) {
      sources.push_back({&s, static_cast<uint32_t>(i), static_cast<uint32_t>(i)});
    }
  }
  std::vector<PlacedSlice> destinations;
  uint64_t needed = 0;
  for (size_t i = 0; i < dst_buffers.size(); ++i) {
    for (const TensorSlice& s : dst_buffers[i]) {
      destinations.push_back({&s, static_cast<uint32_t>(i), 0});
      needed += s.NumElements() * 2;
    }
  }
  std::printf(
      "70B-shaped TP8 -> TP2 bf16: %zu tensors, %zu source slices, %zu destination "
      "slices, %.2f GiB to write; validating all buffers: %.2f ms\n",
      model.size(), sources.size(), destinations.size(), static_cast<double>(needed) / (1ull << 30),
      validate_ms);
  for (bool multi_row : {true, false}) {
    PlanOptions options;
    options.multi_row_ops = multi_row;
    std::vector<double> ms;
    size_t ops = 0;
    double ratio = 0;
    for (int r = 0; r < (multi_row ? repetitions : std::max(1, repetitions / 3)); ++r) {
      const auto t0 = Clock::now();
      absl::StatusOr<Plan> plan = BuildPlan(sources, destinations, options);
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (!plan.ok()) {
        std::printf("BuildPlan failed: %s\n", plan.status().ToString().c_str());
        return 1;
      }
      ops = plan->ops.size();
      ratio = static_cast<double>(plan->src_bytes) / static_cast<double>(needed);
    }
    std::printf("%-16s median %8.2f ms over %zu runs, %9zu ops, src_bytes / needed = %.4f\n",
                multi_row ? "multi-row ops:" : "single-row ops:", Median(ms), ms.size(), ops,
                ratio);
  }
  return 0;
}

}  // namespace
}  // namespace refit::plan

int main(int argc, char** argv) {
  const int repetitions = argc > 1 ? std::max(1, std::atoi(argv[1])) : 9;
  return refit::plan::Run(repetitions);
}
