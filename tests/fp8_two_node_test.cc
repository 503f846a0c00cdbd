// fp8 engines between two real refitd processes (issue 34): a trainer's node publishes bf16, an
// engine's node holds FP8_E4M3 destinations with [128, 128] block scales in FP32
// `weight_scale_inv` tensors, as TP ranks would (row shards of one weight, column shards of
// another, each rank's fp8 slices and scale slices in its own buffer). Each version is pulled
// over UCX, quantized on the engine's node as its bytes land, and Applied; the bytes are
// compared with the quantization rule's reference (cuda/quantize_testing.h: the scalar rule
// written from the text, independently of the kernels). A full version, then RL-like deltas;
// Applies tried while a version is being pulled either fail or give the whole quantized
// version, never part of it; inf/NaN are quantized by the rule and counted; bad layouts are
// refused with INVALID_ARGUMENT and change nothing.

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "cuda/quantize_testing.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/two_nodes.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::MakeShm;
using testing::TwoNodes;

double Metric(client::Client& c, const std::string& name) {
  auto s = c.Status();
  REQUIRE(s.ok());
  auto it = s->metrics().find(name);
  return it == s->metrics().end() ? 0.0 : it->second;
}

// One bf16 weight of the trainer: [rows, cols] at `offset` of its buffer.
struct Weight {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  uint64_t offset = 0;
  int64_t grid_rows() const { return (rows + 127) / 128; }
  int64_t grid_cols() const { return (cols + 127) / 128; }
};

uint16_t* Elements(SharedMemory& shm, const Weight& w) {
  return reinterpret_cast<uint16_t*>(shm.data() + w.offset);
}

// The rule's bytes and scales of the whole weight, from the trainer's bf16 bytes.
cuda::testing::ReferenceQuantized Reference(SharedMemory& src, const Weight& w) {
  const uint16_t* e = Elements(src, w);
  std::vector<float> x(static_cast<size_t>(w.rows * w.cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = cuda::testing::Bf16ToFloat(e[i]);
  std::vector<uint32_t> block_of_row(static_cast<size_t>(w.rows));
  for (int64_t r = 0; r < w.rows; ++r) block_of_row[r] = static_cast<uint32_t>(r / 128);
  return cuda::testing::ReferenceQuantize(x, static_cast<uint64_t>(w.rows),
                                          static_cast<uint64_t>(w.cols), 128, block_of_row,
                                          static_cast<uint64_t>(w.grid_rows()));
}

// One engine rank's box of a weight: rows [r0, r0 + nr) x cols [c0, c0 + nc), its fp8 bytes at
// `q_offset` and its scales (the box's blocks) at `s_offset` of the rank's buffer, row-major.
struct Box {
  const Weight* w = nullptr;
  int64_t r0 = 0, nr = 0, c0 = 0, nc = 0;
  uint64_t q_offset = 0;
  uint64_t s_offset = 0;
  int64_t gr0() const { return r0 / 128; }
  int64_t gnr() const { return (r0 + nr + 127) / 128 - gr0(); }
  int64_t gc0() const { return c0 / 128; }
  int64_t gnc() const { return (c0 + nc + 127) / 128 - gc0(); }
  uint64_t q_bytes() const { return static_cast<uint64_t>(nr * nc); }
  uint64_t s_bytes() const { return static_cast<uint64_t>(gnr() * gnc()) * 4; }
  std::vector<v1::TensorSlice> Slices() const {
    v1::TensorSlice q =
        Slice(w->name, v1::FP8_E4M3, {w->rows, w->cols}, q_offset, {r0, c0}, {nr, nc});
    q.set_scale_tensor(w->name + "_scale_inv");
    q.add_scale_block(128);
    q.add_scale_block(128);
    v1::TensorSlice s = Slice(w->name + "_scale_inv", v1::FP32, {w->grid_rows(), w->grid_cols()},
                              s_offset, {gr0(), gc0()}, {gnr(), gnc()});
    return {q, s};
  }
};

// Whether `dst` holds the reference's bytes and scales of every box; names the first that
// differs in `why`.
bool Holds(SharedMemory& dst, const std::vector<Box>& boxes,
           const std::map<const Weight*, cuda::testing::ReferenceQuantized>& ref,
           std::string* why) {
  for (const Box& b : boxes) {
    const auto& r = ref.at(b.w);
    for (int64_t i = 0; i < b.nr; ++i) {
      const uint8_t* want = r.q.data() + (b.r0 + i) * b.w->cols + b.c0;
      if (std::memcmp(dst.data() + b.q_offset + i * b.nc, want, static_cast<size_t>(b.nc)) != 0) {
        *why = b.w->name + " fp8 row " + std::to_string(b.r0 + i);
        return false;
      }
    }
    const float* scales = reinterpret_cast<const float*>(dst.data() + b.s_offset);
    for (int64_t i = 0; i < b.gnr(); ++i) {
      for (int64_t j = 0; j < b.gnc(); ++j) {
        const float want = r.scales[(b.gr0() + i) * b.w->grid_cols() + b.gc0() + j];
        if (cuda::testing::FloatBits(scales[i * b.gnc() + j]) != cuda::testing::FloatBits(want)) {
          *why = b.w->name + "_scale_inv[" + std::to_string(b.gr0() + i) + ", " +
                 std::to_string(b.gc0() + j) + "]";
          return false;
        }
      }
    }
  }
  return true;
}

// Normal bf16 values of mixed sign and magnitude.
void FillWeights(SharedMemory& src, uint64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  uint16_t* e = reinterpret_cast<uint16_t*>(src.data());
  for (uint64_t i = 0; i < bytes / 2; ++i) {
    e[i] = static_cast<uint16_t>((rng() & 0x83ff) | 0x3800);  // +-2^-15 .. 2^-8 ... +-2^-1
  }
}

TEST_CASE(
    "fp8 engine node: pulled bf16 quantized into TP-sharded fp8 + weight_scale_inv, "
    "full then deltas, bit-exact with the reference",
    "[integration][fp8]") {
  TwoNodes nodes;
  auto& trainer = nodes.trainer;
  auto& engine = nodes.engine;

  // The trainer's model: w [1024, 2000] (a column-block tail of 80), u [300, 384] (a row-block
  // tail of 44), n [1000] bf16 (no scales: a plain copy beside them). 4.4 MB.
  Weight w{"layers.0.w.weight", 1024, 2000, 0};
  Weight u{"layers.0.u.weight", 300, 384, w.offset + 1024 * 2000 * 2};
  const uint64_t n_offset = u.offset + 300 * 384 * 2, n_count = 1000;
  const uint64_t src_bytes = n_offset + n_count * 2;
  SharedMemory src = MakeShm(src_bytes);
  auto src_id = trainer->RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice(w.name, v1::BF16, {w.rows, w.cols}, w.offset),
       Slice(u.name, v1::BF16, {u.rows, u.cols}, u.offset), Slice("n", v1::BF16, {1000}, n_offset)},
      "trainer");
  REQUIRE(src_id.ok());

  // Two engine ranks: w by rows (tensor parallel along the output), u by columns (a reshard:
  // 384 strided short rows per rank), each rank's scales beside its fp8 bytes; n on rank 0.
  std::vector<std::vector<Box>> ranks(2);
  std::vector<uint64_t> rank_bytes(2);
  for (int k = 0; k < 2; ++k) {
    uint64_t at = 0;
    auto place = [&at](Box b) {
      b.q_offset = at;
      at += (b.q_bytes() + 63) / 64 * 64;
      b.s_offset = at;
      at += (b.s_bytes() + 63) / 64 * 64;
      return b;
    };
    ranks[k].push_back(place(Box{&w, k * 512, 512, 0, w.cols}));
    ranks[k].push_back(place(Box{&u, 0, u.rows, k * 256, k == 0 ? 256 : 128}));
    rank_bytes[k] = at + (k == 0 ? n_count * 2 : 0);
  }
  std::vector<SharedMemory> dst;
  std::vector<std::string> dst_ids;
  for (int k = 0; k < 2; ++k) {
    dst.push_back(MakeShm(rank_bytes[k]));
    std::vector<v1::TensorSlice> slices;
    for (const Box& b : ranks[k]) {
      for (const v1::TensorSlice& s : b.Slices()) slices.push_back(s);
    }
    if (k == 0) slices.push_back(Slice("n", v1::BF16, {1000}, rank_bytes[0] - n_count * 2));
    auto id = engine->RegisterBuffer("m", v1::DESTINATION, dst[k].name(), slices,
                                     "engine-rank-" + std::to_string(k));
    REQUIRE(id.ok());
    dst_ids.push_back(*id);
  }

  uint16_t* e = reinterpret_cast<uint16_t*>(src.data());
  std::mt19937 step_rng(7);
  for (uint64_t version = 1; version <= 3; ++version) {
    INFO("version " << version);
    if (version == 1) {
      FillWeights(src, src_bytes, 1);
    } else {
      // An RL-like step: 0.1 % of the elements move by one unit in the last place.
      for (uint64_t c = 0; c < src_bytes / 2 / 1000; ++c) {
        const uint64_t i = step_rng() % (src_bytes / 2);
        e[i] = static_cast<uint16_t>(e[i] + 1);
      }
    }
    std::map<const Weight*, cuda::testing::ReferenceQuantized> ref{{&w, Reference(src, w)},
                                                                   {&u, Reference(src, u)}};
    std::vector<uint16_t> n_want(e + n_offset / 2, e + n_offset / 2 + n_count);
    const double received_before = Metric(*engine, "refit_data_bytes_received_total");

    // Applies tried while the version is pulled and quantized: each fails (not complete yet)
    // or lands the whole version; a copy of the buffers is kept at each success.
    std::atomic<bool> stop{false};
    int early_ok = 0, early_refused = 0;
    bool early_whole = true;
    std::string early_why;
    std::thread applier([&] {
      auto c = nodes.engine_node->Connect();
      if (!c.ok()) {
        early_whole = false;
        early_why = c.status().ToString();
        return;
      }
      while (!stop) {
        auto applied = (*c)->Apply("m", version, dst_ids);
        if (applied.ok()) {
          ++early_ok;
          early_whole = early_whole && Holds(dst[0], ranks[0], ref, &early_why) &&
                        Holds(dst[1], ranks[1], ref, &early_why);
          return;
        }
        ++early_refused;
        std::this_thread::sleep_for(milliseconds(1));
      }
    });
    auto published = trainer->Publish("m", version, {*src_id});
    REQUIRE(published.ok());
    auto ready = engine->WaitForVersion("m", version, std::chrono::seconds(30));
    stop = true;
    applier.join();
    REQUIRE(ready.ok());
    CHECK(early_whole);
    INFO(early_why);
    auto applied = engine->Apply("m", version, dst_ids);
    REQUIRE(applied.ok());
    std::string why;
    CHECK(Holds(dst[0], ranks[0], ref, &why));
    INFO(why);
    CHECK(Holds(dst[1], ranks[1], ref, &why));
    CHECK(std::memcmp(dst[0].data() + rank_bytes[0] - n_count * 2, n_want.data(), n_count * 2) ==
          0);
    const double received = Metric(*engine, "refit_data_bytes_received_total") - received_before;
    if (version == 1) {
      CHECK(received >= static_cast<double>(src_bytes));
    } else {
      CHECK(received < static_cast<double>(src_bytes) / 4);  // a delta crossed, not the model
    }
    auto status = testing::ModelStatusOf(*engine, "m");
    REQUIRE(status.ok());
    CHECK(status->latest_nonfinite_values() == 0);
    UNSCOPED_INFO("version " << version << ": " << received << " bytes pulled, Applies during the "
                             << "pull refused " << early_refused << ", whole " << early_ok);
  }
  CHECK(Metric(*engine, "refit_quantized_values_total") >=
        3.0 * static_cast<double>(w.rows * w.cols + u.rows * u.cols));
  CHECK(Metric(*engine, "refit_nonfinite_values_total") == 0);
}

TEST_CASE("fp8 engine node: inf and NaN in a pulled version are quantized by the rule and counted",
          "[integration][fp8]") {
  TwoNodes nodes;
  Weight w{"w", 256, 256, 0};
  SharedMemory src = MakeShm(256 * 256 * 2);
  auto src_id = nodes.trainer->RegisterBuffer("m", v1::SOURCE, src.name(),
                                              {Slice(w.name, v1::BF16, {256, 256}, 0)}, "trainer");
  REQUIRE(src_id.ok());
  Box whole{&w, 0, 256, 0, 256, 0, 256 * 256};
  SharedMemory dst = MakeShm(256 * 256 + 16);
  auto dst_id =
      nodes.engine->RegisterBuffer("m", v1::DESTINATION, dst.name(), whole.Slices(), "engine");
  REQUIRE(dst_id.ok());
  FillWeights(src, 256 * 256 * 2, 3);
  uint16_t* e = Elements(src, w);
  e[5] = 0x7fc0;                // NaN in block [0, 0]
  e[130 * 256 + 200] = 0x7f80;  // +inf in block [1, 1]
  e[131 * 256 + 201] = 0xff80;  // -inf in block [1, 1]
  auto ref = Reference(src, w);
  REQUIRE(ref.nonfinite == 3);
  REQUIRE(nodes.trainer->Publish("m", 1, {*src_id}).ok());
  REQUIRE(nodes.engine->WaitForVersion("m", 1, std::chrono::seconds(30)).ok());
  REQUIRE(nodes.engine->Apply("m", 1, {*dst_id}).ok());
  std::string why;
  CHECK(Holds(dst, {whole}, {{&w, ref}}, &why));
  INFO(why);
  const float* scales = reinterpret_cast<const float*>(dst.data() + whole.s_offset);
  CHECK(std::isnan(scales[0]));
  CHECK(std::isinf(scales[3]));
  CHECK(std::isfinite(scales[1]));
  auto status = testing::ModelStatusOf(*nodes.engine, "m");
  REQUIRE(status.ok());
  CHECK(status->latest_nonfinite_values() == 3);
  CHECK(Metric(*nodes.engine, "refit_nonfinite_values_total") == 3);
}

TEST_CASE("fp8 engine node: bad layouts are refused with INVALID_ARGUMENT and change nothing",
          "[integration][fp8]") {
  TwoNodes nodes;
  auto& engine = nodes.engine;
  Weight w{"w", 512, 512, 0};
  SharedMemory src = MakeShm(512 * 512 * 2);
  auto src_id = nodes.trainer->RegisterBuffer("m", v1::SOURCE, src.name(),
                                              {Slice(w.name, v1::BF16, {512, 512}, 0)}, "trainer");
  REQUIRE(src_id.ok());
  SharedMemory dst = MakeShm(512 * 512 + 4096);
  Box whole{&w, 0, 512, 0, 512, 0, 512 * 512};

  auto refused = [&](std::vector<v1::TensorSlice> slices, const std::string& words) {
    auto id = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(), slices, "engine");
    REQUIRE_FALSE(id.ok());
    CHECK(id.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(id.status().message()), Catch::Contains(words));
    // Nothing registered: the engine's node has no destination of the model.
    auto status = testing::ModelStatusOf(*engine, "m");
    if (status.ok()) CHECK(status->destination_buffers() == 0);
  };

  SECTION("a scale tensor of the wrong shape") {
    std::vector<v1::TensorSlice> slices = whole.Slices();
    slices[1] = Slice("w_scale_inv", v1::FP32, {4, 3}, whole.s_offset);  // [4, 4] is right
    refused(slices, "w_scale_inv");
  }
  SECTION("a scale tensor of the wrong dtype") {
    std::vector<v1::TensorSlice> slices = whole.Slices();
    slices[1] = Slice("w_scale_inv", v1::BF16, {4, 4}, whole.s_offset);
    refused(slices, "w_scale_inv");
  }
  SECTION("a destination shard that cuts a block") {
    Box cut{&w, 0, 200, 0, 512, 0, 200 * 512};  // rows 0..199: block row 1 cut at 200
    refused(cut.Slices(), "block");
  }
  SECTION("a missing scale tensor") { refused({whole.Slices()[0]}, "w_scale_inv"); }
  // The daemon still serves: the right layout registers and a version arrives bit-exact.
  auto dst_id = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(), whole.Slices(), "engine");
  REQUIRE(dst_id.ok());
  FillWeights(src, 512 * 512 * 2, 5);
  REQUIRE(nodes.trainer->Publish("m", 1, {*src_id}).ok());
  REQUIRE(engine->WaitForVersion("m", 1, std::chrono::seconds(30)).ok());
  REQUIRE(engine->Apply("m", 1, {*dst_id}).ok());
  std::string why;
  CHECK(Holds(dst, {whole}, {{&w, Reference(src, w)}}, &why));
  INFO(why);
}

}  // namespace
}  // namespace refit
