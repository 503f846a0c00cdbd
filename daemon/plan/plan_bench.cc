// Plans a 70B-shaped (Llama-3-70B) reshard from TP8 trainer buffers to TP2 inference buffers and
// prints the median planning time, the op count and src_bytes over the bytes the destinations
// need, for single-row and multi-row ops; then plain vs verified execution of a ~1 GiB model.
// "execution" also times the full Apply as the store runs it, with its undo journal's save of
// the destinations: save pass then plain copy (reference), save pass then verified copy, and the
// save folded into the verified copy.
// Usage: plan_bench [repetitions] | plan_bench execution [ROUNDS [LAYERS [VOCAB]]]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
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

// Seconds of wall time and of CPU time (every thread of the process) of one execution.
struct Timing {
  double wall = 0;
  double cpu = 0;
};

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// How one execution runs: the copy alone, plain or verified; or as the store's full Apply runs
// it, the undo journal's save of the destinations first (a streaming copy of each destination
// buffer into a journal area, as daemon/store/apply_journal does) and then the plain or verified
// copy; or the save folded into the verified copy (ExecuteSaveAndVerifyOnHost).
enum class Mode { kPlain, kVerified, kSaveThenPlain, kSaveThenVerified, kFolded };

// Executes `plan` once between freshly touched buffers.
Timing TimeExecution(const Plan& plan, const std::vector<uint64_t>& src_sizes,
                     const std::vector<uint64_t>& dst_sizes, Mode mode = Mode::kPlain) {
  std::vector<std::vector<uint8_t>> src, dst;
  for (uint64_t n : src_sizes) src.emplace_back(n, 1);
  for (uint64_t n : dst_sizes) dst.emplace_back(n, 0);
  std::vector<const uint8_t*> s;
  std::vector<uint8_t*> d;
  for (auto& b : src) s.push_back(b.data());
  for (auto& b : dst) d.push_back(b.data());
  // The journal area, touched (the store keeps its journal slot mapped between Applies), and the
  // plan of the save pass: each destination buffer, whole, into it.
  const bool saves = mode == Mode::kSaveThenPlain || mode == Mode::kSaveThenVerified;
  Plan save;
  uint64_t journal_bytes = mode == Mode::kFolded ? SavedBytes(plan) : 0;
  if (saves) {
    for (size_t i = 0; i < dst_sizes.size(); ++i) {
      CopyOp op;
      op.src_location = static_cast<uint32_t>(i);
      op.dst_offset = journal_bytes;
      op.count = dst_sizes[i];
      op.src_dtype = op.dst_dtype = DType::kUINT8;
      save.ops.push_back(op);
      journal_bytes += dst_sizes[i];
    }
    save.src_bytes = save.dst_bytes = journal_bytes;
  }
  std::vector<uint8_t> journal(journal_bytes, 2);
  const double c0 = CpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  if (saves) ExecuteOnHost(save, {d.begin(), d.end()}, {journal.data()});
  switch (mode) {
    case Mode::kPlain:
    case Mode::kSaveThenPlain:
      ExecuteOnHost(plan, s, d);
      break;
    case Mode::kVerified:
    case Mode::kSaveThenVerified:
      if (!ExecuteAndVerifyOnHost(plan, s, d).empty()) std::abort();
      break;
    case Mode::kFolded:
      if (!ExecuteSaveAndVerifyOnHost(plan, s, d, journal.data()).empty()) std::abort();
      break;
  }
  Timing t;
  t.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t.cpu = CpuSeconds() - c0;
  return t;
}

struct Series {
  std::vector<double> wall, cpu;
  void Add(const Timing& t) {
    wall.push_back(t.wall);
    cpu.push_back(t.cpu);
  }
  double Wall() const { return Median(wall); }
  double Cpu() const { return Median(cpu); }
  double BestCpu() const { return *std::min_element(cpu.begin(), cpu.end()); }
};

// Resharded (TP8 -> TP2) vs unresharded (TP1 -> TP1) execution of the same model: plain
// (ExecuteOnHost) and verified (ExecuteAndVerifyOnHost), memcpy as the reference.
int RunExecution(int runs, int layers, int64_t vocab, bool with_journal) {
  const std::vector<Tensor> model = Llama(2048, 5632, 512, vocab, layers);
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
  Series plain_s, plain_r, verified_s, verified_r, copies;
  // The full Apply with its undo journal (see Mode), unresharded and resharded.
  Series saved_plain_s, saved_verified_s, folded_s, saved_plain_r, saved_verified_r, folded_r;
  std::vector<uint8_t> from(straight->dst_bytes, 1), to(straight->dst_bytes, 0);
  for (int r = 0; r < runs; ++r) {
    plain_s.Add(TimeExecution(*straight, ss_b, ds_b));
    verified_s.Add(TimeExecution(*straight, ss_b, ds_b, Mode::kVerified));
    plain_r.Add(TimeExecution(*resharded, ss_a, ds_a));
    verified_r.Add(TimeExecution(*resharded, ss_a, ds_a, Mode::kVerified));
    if (with_journal) {
      saved_plain_s.Add(TimeExecution(*straight, ss_b, ds_b, Mode::kSaveThenPlain));
      saved_verified_s.Add(TimeExecution(*straight, ss_b, ds_b, Mode::kSaveThenVerified));
      folded_s.Add(TimeExecution(*straight, ss_b, ds_b, Mode::kFolded));
      saved_plain_r.Add(TimeExecution(*resharded, ss_a, ds_a, Mode::kSaveThenPlain));
      saved_verified_r.Add(TimeExecution(*resharded, ss_a, ds_a, Mode::kSaveThenVerified));
      folded_r.Add(TimeExecution(*resharded, ss_a, ds_a, Mode::kFolded));
    }
    const double c0 = CpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), from.size());
    copies.Add({std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                CpuSeconds() - c0});
  }
  const double t_straight = plain_s.Wall(), t_resharded = plain_r.Wall();
  std::printf(
      "execution, %.2f GiB bf16 (%d layers, hidden 2048, vocab %lld), median of %d rounds, "
      "%u cores:\n"
      "  unresharded TP1 -> TP1: %7.2f GB/s (%zu ops)\n"
      "  resharded   TP8 -> TP2: %7.2f GB/s (%zu ops) = %.2fx unresharded\n",
      bytes / (1ull << 30), layers, static_cast<long long>(vocab), runs,
      std::max(1u, std::thread::hardware_concurrency()), bytes / t_straight / 1e9,
      straight->ops.size(), bytes / t_resharded / 1e9, resharded->ops.size(),
      t_straight / t_resharded);
  // Wall time: what an engine waits. CPU time (every thread): what the cores spent, steadier
  // on a machine shared with other work.
  auto line = [&](const char* what, const Series& verified, const Series& plain) {
    std::printf(
        "  %-40s wall %7.2f GB/s vs plain %7.2f GB/s: verified / plain = %.2fx   "
        "cpu %7.2f vs %7.2f GB/s: %.2fx (best rounds %.2fx)\n",
        what, bytes / verified.Wall() / 1e9, bytes / plain.Wall() / 1e9,
        plain.Wall() / verified.Wall(), bytes / verified.Cpu() / 1e9, bytes / plain.Cpu() / 1e9,
        plain.Cpu() / verified.Cpu(), plain.BestCpu() / verified.BestCpu());
  };
  std::printf(
      "verified apply (memcpy ops copied and compared in 32 KiB batches), median of %d:\n"
      "  memcpy (one thread, reference): wall %7.2f GB/s, cpu %7.2f GB/s\n",
      runs, bytes / copies.Wall() / 1e9, bytes / copies.Cpu() / 1e9);
  line("unresharded", verified_s, plain_s);
  line("resharded", verified_r, plain_r);
  std::printf("verified / plain, full apply: unresharded %.2fx, resharded %.2fx (wall)\n",
              plain_s.Wall() / verified_s.Wall(), plain_r.Wall() / verified_r.Wall());
  if (!with_journal) return 0;
  std::printf(
      "with the undo journal's save of the destinations (the store's full Apply), median of %d; "
      "reference: save pass, then the plain copy:\n",
      runs);
  line("unresharded, save pass + verified", saved_verified_s, saved_plain_s);
  line("unresharded, save folded into verified", folded_s, saved_plain_s);
  line("resharded, save pass + verified", saved_verified_r, saved_plain_r);
  line("resharded, save folded into verified", folded_r, saved_plain_r);
  std::printf(
      "verified / plain, full apply with its undo save: save pass %.2fx / %.2fx, folded %.2fx / "
      "%.2fx (unresharded / resharded, wall; cpu %.2fx / %.2fx, folded %.2fx / %.2fx)\n",
      saved_plain_s.Wall() / saved_verified_s.Wall(),
      saved_plain_r.Wall() / saved_verified_r.Wall(), saved_plain_s.Wall() / folded_s.Wall(),
      saved_plain_r.Wall() / folded_r.Wall(), saved_plain_s.Cpu() / saved_verified_s.Cpu(),
      saved_plain_r.Cpu() / saved_verified_r.Cpu(), saved_plain_s.Cpu() / folded_s.Cpu(),
      saved_plain_r.Cpu() / folded_r.Cpu());
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
    // plan_bench execution [ROUNDS [LAYERS [VOCAB]]]: 8 layers and a 32000 vocabulary are
    // ~0.92 GiB; 2 layers and 8000, ~0.23 GiB.
    return refit::plan::RunExecution(argc > 2 ? std::max(1, std::atoi(argv[2])) : 9,
                                     argc > 3 ? std::max(1, std::atoi(argv[3])) : 8,
                                     argc > 4 ? std::max(1, std::atoi(argv[4])) : 32000,
                                     /*with_journal=*/true);
  }
  const int repetitions = argc > 1 ? std::max(1, std::atoi(argv[1])) : 9;
  const int status = refit::plan::Run(repetitions);
  return status != 0 ? status : refit::plan::RunExecution(5, 8, 32000, /*with_journal=*/false);
}
