// Resharding through the real daemons: a Llama-style model held by a TP4 trainer (four SOURCE
// buffers; separate q/k/v/gate/up split on dim 0, o/down split on dim 1, norms replicated) is
// applied to a TP2 engine (fused qkv_proj and gate_up_proj; engine rank 1 in fp16), on one node
// and across two daemons. Every destination element is checked against a reference computed
// here, and across daemons the wire bytes equal the bytes the destinations need.

#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

constexpr int64_t kHidden = 64, kInter = 96, kKv = 32, kLayers = 2, kTp = 4, kEngineTp = 2;

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int split;  // -1 replicated, 0 rows, 1 columns
};

std::vector<Tensor> Model() {
  std::vector<Tensor> t;
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "self_attn.q_proj.weight", {kHidden, kHidden}, 0});
    t.push_back({p + "self_attn.k_proj.weight", {kKv, kHidden}, 0});
    t.push_back({p + "self_attn.v_proj.weight", {kKv, kHidden}, 0});
    t.push_back({p + "self_attn.o_proj.weight", {kHidden, kHidden}, 1});
    t.push_back({p + "mlp.gate_proj.weight", {kInter, kHidden}, 0});
    t.push_back({p + "mlp.up_proj.weight", {kInter, kHidden}, 0});
    t.push_back({p + "mlp.down_proj.weight", {kHidden, kInter}, 1});
    t.push_back({p + "input_layernorm.weight", {kHidden}, -1});
  }
  return t;
}

// The value of element (r, c) of a tensor at a version: distinct everywhere.
float Value(size_t tensor, int64_t r, int64_t c, uint64_t version) {
  return static_cast<float>(tensor * 100000 + r * 1000 + c) * 0.001f + static_cast<float>(version);
}

// One rank's shard of `t` as a slice: offsets and sizes for `rank` of `ranks`.
void Shard(const Tensor& t, int rank, int ranks, std::vector<int64_t>* offsets,
           std::vector<int64_t>* sizes) {
  *sizes = t.shape;
  offsets->assign(t.shape.size(), 0);
  if (t.split < 0) return;
  (*sizes)[t.split] = t.shape[t.split] / ranks;
  (*offsets)[t.split] = rank * (*sizes)[t.split];
}

struct SourceRank {
  SharedMemory shm;
  std::vector<v1::TensorSlice> slices;
  std::vector<std::vector<int64_t>> offsets, sizes;
  std::vector<uint64_t> at;  // byte offset per tensor
};

SourceRank MakeSource(int rank) {
  const auto model = Model();
  SourceRank s{
      SharedMemory::Create(testing::UniqueShmName("tp4"), 1, false).value(), {}, {}, {}, {}};
  uint64_t bytes = 0;
  for (const Tensor& t : model) {
    std::vector<int64_t> off, size;
    Shard(t, rank, kTp, &off, &size);
    uint64_t n = 1;
    for (int64_t d : size) n *= d;
    s.slices.push_back(Slice(t.name, v1::FP32, t.shape, bytes, off, size));
    s.offsets.push_back(off);
    s.sizes.push_back(size);
    s.at.push_back(bytes);
    bytes += n * 4;
  }
  s.shm = SharedMemory::Create(testing::UniqueShmName("tp4"), bytes).value();
  return s;
}

void FillSource(SourceRank& s, uint64_t version) {
  const auto model = Model();
  for (size_t i = 0; i < model.size(); ++i) {
    float* p = reinterpret_cast<float*>(s.shm.data() + s.at[i]);
    const int64_t rows = s.sizes[i][0], cols = s.sizes[i].size() > 1 ? s.sizes[i][1] : 1;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t gr = s.offsets[i][0] + r,
                      gc = cols > 1 || s.sizes[i].size() > 1 ? s.offsets[i].back() + c : 0;
        p[r * cols + c] =
            s.sizes[i].size() > 1 ? Value(i, gr, gc, version) : Value(i, 0, gr, version);
      }
    }
  }
}

// An engine rank: per layer qkv_proj = [q; k; v] and gate_up_proj = [gate; up] fused.
struct EngineRank {
  SharedMemory shm;
  std::vector<v1::TensorSlice> slices;
  struct Where {
    size_t tensor;
    std::vector<int64_t> offsets, sizes;
    uint64_t at;
  };
  std::vector<Where> where;
  v1::DType dtype;
  uint64_t elements = 0;
};

EngineRank MakeEngine(int rank, v1::DType dtype) {
  const auto model = Model();
  const uint64_t es = dtype == v1::FP16 ? 2 : 4;
  EngineRank e{SharedMemory::Create(testing::UniqueShmName("tp2"), 1).value(), {}, {}, dtype, 0};
  uint64_t bytes = 0;
  // Model order already lists q, k, v and gate, up adjacently: consecutive offsets fuse them.
  for (size_t i = 0; i < model.size(); ++i) {
    std::vector<int64_t> off, size;
    Shard(model[i], rank, kEngineTp, &off, &size);
    uint64_t n = 1;
    for (int64_t d : size) n *= d;
    e.slices.push_back(Slice(model[i].name, dtype, model[i].shape, bytes, off, size));
    e.where.push_back({i, off, size, bytes});
    e.elements += n;
    bytes += n * es;
  }
  e.shm = SharedMemory::Create(testing::UniqueShmName("tp2"), bytes).value();
  std::memset(e.shm.data(), 0, bytes);
  return e;
}

void CheckEngine(const EngineRank& e, uint64_t version) {
  size_t wrong = 0;
  for (const auto& w : e.where) {
    const int64_t rows = w.sizes[0], cols = w.sizes.size() > 1 ? w.sizes[1] : 1;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float want = w.sizes.size() > 1
                               ? Value(w.tensor, w.offsets[0] + r, w.offsets[1] + c, version)
                               : Value(w.tensor, 0, w.offsets[0] + r, version);
        const uint64_t i = static_cast<uint64_t>(r * cols + c);
        if (e.dtype == v1::FP16) {
          _Float16 got;
          std::memcpy(&got, e.shm.data() + w.at + i * 2, 2);
          const _Float16 ref = static_cast<_Float16>(want);  // IEEE round to nearest even
          if (std::memcmp(&got, &ref, 2) != 0) wrong++;
        } else {
          float got;
          std::memcpy(&got, e.shm.data() + w.at + i * 4, 4);
          if (std::memcmp(&got, &want, 4) != 0) wrong++;
        }
      }
    }
  }
  CHECK(wrong == 0);
}

void Run(bool two_daemons) {
  auto trainer_node = testing::DaemonProcess::Start({"--node=trainer"});
  REQUIRE(trainer_node.ok());
  std::unique_ptr<testing::DaemonProcess> engine_node;
  if (two_daemons) {
    auto trainer_client = (*trainer_node)->Connect();
    REQUIRE(trainer_client.ok());
    const int port = (*trainer_client)->Status()->listen_port();
    auto started = testing::DaemonProcess::Start(
        {"--node=engine", "--peers=127.0.0.1:" + std::to_string(port)});
    REQUIRE(started.ok());
    engine_node = std::move(started).value();
  }
  auto trainer = (*trainer_node)->Connect();
  auto engine = (two_daemons ? engine_node.get() : trainer_node->get())->Connect();
  REQUIRE(trainer.ok());
  REQUIRE(engine.ok());
  if (two_daemons) {
    for (int i = 0; i < 200; ++i) {
      auto s = (*engine)->Status();
      if (s.ok() && s->peers_size() == 1 && s->peers(0).connected()) break;
      std::this_thread::sleep_for(milliseconds(50));
    }
  }

  std::vector<SourceRank> ranks;
  std::vector<std::string> source_ids;
  for (int r = 0; r < kTp; ++r) {
    ranks.push_back(MakeSource(r));
    auto id = (*trainer)->RegisterBuffer("llama", v1::SOURCE, ranks.back().shm.name(),
                                         ranks.back().slices, "tp-rank-" + std::to_string(r));
    REQUIRE(id.ok());
    source_ids.push_back(*id);
  }
  std::vector<EngineRank> engines;
  std::vector<std::string> dest_ids;
  for (int r = 0; r < kEngineTp; ++r) {
    engines.push_back(MakeEngine(r, r == 1 ? v1::FP16 : v1::FP32));
    auto id = (*engine)->RegisterBuffer("llama", v1::DESTINATION, engines.back().shm.name(),
                                        engines.back().slices);
    REQUIRE(id.ok());
    dest_ids.push_back(*id);
  }
  for (uint64_t v = 1; v <= 2; ++v) {
    for (int r = 0; r < kTp; ++r) {
      FillSource(ranks[r], v);
      REQUIRE((*trainer)->Publish("llama", v, {source_ids[r]}).ok());
    }
    REQUIRE((*engine)->WaitForVersion("llama", v, milliseconds(30000)).ok());
    for (int r = 0; r < kEngineTp; ++r) {
      auto applied = (*engine)->Apply("llama", v, {dest_ids[r]});
      REQUIRE(applied.ok());
      CHECK(applied->bytes_written() == engines[r].shm.size());
      CheckEngine(engines[r], v);
    }
  }
  if (two_daemons) {
    // The wire carried each destination element once, as the source's fp32.
    const double needed = 4.0 * static_cast<double>(engines[0].elements + engines[1].elements);
    auto status = (*engine)->Status();
    REQUIRE(status.ok());
    CHECK(status->metrics().at("refit_data_bytes_received_total") == 2 * needed);
  }
}

TEST_CASE("TP4 trainer to fused TP2 engine (one rank fp16) on one node", "[integration][reshard]") {
  Run(false);
}

TEST_CASE("TP4 trainer to fused TP2 engine (one rank fp16) across two daemons",
          "[integration][reshard]") {
  Run(true);
}

}  // namespace
}  // namespace refit
