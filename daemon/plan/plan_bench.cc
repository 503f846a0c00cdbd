// Plans a 70B-shaped (Llama-3-70B) reshard from TP8 trainer buffers to TP2 inference buffers and
// prints the median planning time, the op count and src_bytes over the bytes the destinations
// need, for single-row and multi-row ops. Usage: plan_bench [repetitions]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

std::vector<Tensor> Llama(int64_t hidden, int64_t ffn, int64_t kv, int64_t vocab, int layers) {
  std::vector<Tensor> model{{"model.embed_tokens.weight", {vocab, hidden}, 0}};
  for (int layer = 0; layer < layers; ++layer) {
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

std::vector<Tensor> Llama70B() { return Llama(8192, 28672, 1024, 128256, 80); }

// Executes `plan` `runs` times between freshly touched buffers; returns the median seconds.
double TimeExecution(const Plan& plan, const std::vector<uint64_t>& src_sizes,
                     const std::vector<uint64_t>& dst_sizes, int runs, bool verified = false) {
  std::vector<std::vector<uint8_t>> src, dst;
  for (uint64_t n : src_sizes) src.emplace_back(n, 1);
  for (uint64_t n : dst_sizes) dst.emplace_back(n, 0);
  std::vector<const uint8_t*> s;
  std::vector<uint8_t*> d;
  for (auto& b : src) s.push_back(b.data());
  for (auto& b : dst) d.push_back(b.data());
  std::vector<double> seconds;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (verified) {
      if (!ExecuteAndVerifyOnHost(plan, s, d).empty()) std::abort();
    } else {
      ExecuteOnHost(plan, s, d);
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return Median(seconds);
}

// Resharded (TP8 -> TP2) vs unresharded (TP1 -> TP1) execution of the same ~1 GiB model.
int RunExecution(int runs) {
  const std::vector<Tensor> model = Llama(2048, 5632, 512, 32000, 8);
  auto plan_for = [&](int from, int to, std::vector<uint64_t>* src_sizes,
                      std::vector<uint64_t>* dst_sizes,
                      std::vector<std::vector<TensorSlice>>* keep) -> absl::StatusOr<Plan> {
    auto src = Layout(model, from, src_sizes);
    auto dst = Layout(model, to, dst_sizes);
    for (size_t i = 0; i < src.size(); ++i)
      (void)NormalizeAndValidateBuffer(src[i], (*src_sizes)[i]);
    for (size_t i = 0; i < dst.size(); ++i)
      (void)NormalizeAndValidateBuffer(dst[i], (*dst_sizes)[i]);
    keep->insert(keep->end(), src.begin(), src.end());
    const size_t split = keep->size();
    keep->insert(keep->end(), dst.begin(), dst.end());
    std::vector<PlacedSlice> sources, destinations;
    for (size_t i = 0; i < split; ++i) {
      for (const TensorSlice& t : (*keep)[i]) sources.push_back({&t, uint32_t(i), 0});
    }
    for (size_t i = split; i < keep->size(); ++i) {
      for (const TensorSlice& t : (*keep)[i]) destinations.push_back({&t, uint32_t(i - split), 0});
    }
    PlanOptions options;
    options.multi_row_ops = true;
    return BuildPlan(sources, destinations, options);
  };
  std::vector<std::vector<TensorSlice>> keep_a, keep_b;
  keep_a.reserve(16);
  keep_b.reserve(16);
  std::vector<uint64_t> ss_a, ds_a, ss_b, ds_b;
  auto resharded = plan_for(8, 2, &ss_a, &ds_a, &keep_a);
  auto straight = plan_for(1, 1, &ss_b, &ds_b, &keep_b);
  if (!resharded.ok() || !straight.ok()) return 1;
  const double bytes = static_cast<double>(straight->dst_bytes);
  // Interleaved: each round times plain, verified and memcpy back to back, so that a machine
  // whose load drifts (shared build hosts) weighs on all of them alike; medians over rounds.
  std::vector<double> plain_s, plain_r, verified_s, verified_r, copies;
  std::vector<uint8_t> from(straight->dst_bytes, 1), to(straight->dst_bytes, 0);
  for (int r = 0; r < runs; ++r) {
    plain_s.push_back(TimeExecution(*straight, ss_b, ds_b, 1));
    verified_s.push_back(TimeExecution(*straight, ss_b, ds_b, 1, true));
    plain_r.push_back(TimeExecution(*resharded, ss_a, ds_a, 1));
    verified_r.push_back(TimeExecution(*resharded, ss_a, ds_a, 1, true));
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), from.size());
    copies.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double t_straight = Median(plain_s), t_resharded = Median(plain_r);
  std::printf(
      "execution, %.2f GiB bf16 (8 layers, hidden 2048), median of %d:\n"
      "  unresharded TP1 -> TP1: %7.2f GB/s (%zu ops)\n"
      "  resharded   TP8 -> TP2: %7.2f GB/s (%zu ops) = %.2fx unresharded\n",
      bytes / (1ull << 30), runs, bytes / t_straight / 1e9, straight->ops.size(),
      bytes / t_resharded / 1e9, resharded->ops.size(), t_straight / t_resharded);
  const double t_straight_v = Median(verified_s), t_resharded_v = Median(verified_r);
  const double t_memcpy = Median(copies);
  std::printf(
      "verified apply (memcpy ops copied and compared in 8 KiB pieces), median of %d:\n"
      "  memcpy (one thread, reference): %7.2f GB/s\n"
      "  unresharded verified: %7.2f GB/s = %.2fx plain apply\n"
      "  resharded   verified: %7.2f GB/s = %.2fx plain apply\n",
      runs, bytes / t_memcpy / 1e9, bytes / t_straight_v / 1e9, t_straight / t_straight_v,
      bytes / t_resharded_v / 1e9, t_resharded / t_resharded_v);
  return 0;
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

// plan_bench [REPETITIONS]: both parts; plan_bench execution [ROUNDS]: execution only.
int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "execution") {
    return refit::plan::RunExecution(argc > 2 ? std::max(1, std::atoi(argv[2])) : 9);
  }
  const int repetitions = argc > 1 ? std::max(1, std::atoi(argv[1])) : 9;
  const int status = refit::plan::Run(repetitions);
  return status != 0 ? status : refit::plan::RunExecution(5);
}
