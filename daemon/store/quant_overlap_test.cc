// fp8 destinations with block scales, quantized while the version arrives: a model whose
// SOURCE buffers publish one by one has the pieces published so far quantized before the last
// one lands; the version stays invisible until every piece is quantized; the bytes are those
// of quantizing the whole version after the fact (and of the rule's reference); a version
// overtaken while partly quantized leaves nothing behind; a pulled version (a delta applied to
// the held base) is quantized from the full bytes the pull delivers. Many small tensors are
// quantized in a few tasks, each value once.

#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "cuda/quantize_testing.h"
#include "daemon/store/quantized_slots.h"
#include "daemon/store/store.h"
#include "daemon/store/store_testing.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

StoreOptions Options() {
  StoreOptions options;
  options.retain = 2;
  options.max_spare_slot_bytes = 1ull << 30;
  options.node = "test";
  return options;
}

std::unique_ptr<Region> Host(uint64_t size, uint8_t** data) {
  auto region = AllocateHost(size);
  REQUIRE(region.ok());
  *data = (*region)->data();
  std::memset(*data, 0xEE, size);
  return std::move(region).value();
}

std::vector<uint16_t> RandomBf16(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.03f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

TensorSlice Slice(const std::string& name, DType dtype, std::vector<int64_t> shape,
                  std::vector<int64_t> offsets, std::vector<int64_t> sizes, uint64_t at) {
  TensorSlice s;
  s.name = name;
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  s.buffer_offset = at;
  return s;
}

// The reference of a 2-D bf16 tensor with [128, 128] blocks: fp8 bytes and scales.
cuda::testing::ReferenceQuantized Reference(const uint16_t* x, uint64_t rows, uint64_t cols) {
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r / 128);
  std::vector<float> wide(rows * cols);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = cuda::testing::Bf16ToFloat(x[i]);
  return cuda::testing::ReferenceQuantize(wide, rows, cols, 128, map, (rows + 127) / 128);
}

// Model "m": tensors w0..w3 [256, 384] bf16, w_k whole in SOURCE buffer k, and x [256, 384]
// in row shards of 64 rows, shard k in buffer k (every block band of x spans two buffers).
// One DESTINATION buffer holds every tensor as fp8 with [128, 128] block scales.
constexpr int64_t kRows = 256, kCols = 384;
constexpr uint64_t kElements = kRows * kCols;
constexpr uint64_t kScales = 2 * 3;

struct Model {
  Metrics metrics;
  Store store{Options(), &metrics};
  std::vector<uint8_t*> src;  // per SOURCE buffer: w_k, then x's shard k
  std::vector<std::string> src_ids;
  uint8_t* dst = nullptr;
  std::string dst_id;

  Model() {
    for (int k = 0; k < 4; ++k) {
      uint8_t* data;
      auto region = Host(kElements * 2 + 64 * kCols * 2, &data);
      const std::vector<int64_t> shape{kRows, kCols};
      auto id = store.RegisterBuffer(
          "m", Role::kSource, std::move(region),
          {Slice("w" + std::to_string(k), DType::kBF16, shape, {}, {}, 0),
           Slice("x", DType::kBF16, shape, {64 * k, 0}, {64, kCols}, kElements * 2)},
          "trainer");
      REQUIRE(id.ok());
      src.push_back(data);
      src_ids.push_back(*id);
    }
    std::vector<TensorSlice> slices;
    const std::vector<int64_t> shape{kRows, kCols};
    uint64_t at = 0;
    for (const std::string name : {"w0", "w1", "w2", "w3", "x"}) {
      TensorSlice q = Slice(name, DType::kFP8E4M3, shape, {}, {}, at);
      q.scale_tensor = name + "_scale_inv";
      q.scale_block = {128, 128};
      slices.push_back(q);
      slices.push_back(Slice(q.scale_tensor, DType::kFP32, {2, 3}, {}, {}, at + kElements));
      at += kElements + 4 * kScales;
    }
    auto region = Host(at, &dst);
    auto id = store.RegisterBuffer("m", Role::kDestination, std::move(region), slices, "engine");
    REQUIRE(id.ok());
    dst_id = *id;
  }

  // Fills every source with version-specific values; returns each tensor's bf16 elements.
  std::vector<std::vector<uint16_t>> Fill(uint64_t seed) {
    std::vector<std::vector<uint16_t>> tensors;
    for (int k = 0; k < 5; ++k) tensors.push_back(RandomBf16(kElements, seed * 10 + k));
    for (int k = 0; k < 4; ++k) {
      std::memcpy(src[k], tensors[k].data(), kElements * 2);
      std::memcpy(src[k] + kElements * 2, tensors[4].data() + 64 * k * kCols, 64 * kCols * 2);
    }
    return tensors;
  }

  bool WaitForQuantized(double values) {
    const auto until = Clock::now() + milliseconds(10000);
    while (metrics.Get(kQuantizedValues) < values && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(2));
    }
    return metrics.Get(kQuantizedValues) == values;
  }

  std::vector<uint8_t> Applied(uint64_t version) {
    auto applied = store.Apply("m", version, {dst_id});
    REQUIRE(applied.ok());
    return std::vector<uint8_t>(dst, dst + 5 * (kElements + 4 * kScales));
  }
};

void RequireReference(const std::vector<uint8_t>& got,
                      const std::vector<std::vector<uint16_t>>& tensors) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    INFO("tensor " << t);
    const auto ref = Reference(tensors[t].data(), kRows, kCols);
    const uint8_t* at = got.data() + t * (kElements + 4 * kScales);
    REQUIRE(std::vector<uint8_t>(at, at + kElements) == ref.q);
    for (size_t i = 0; i < kScales; ++i) {
      float s;
      std::memcpy(&s, at + kElements + 4 * i, 4);
      REQUIRE(cuda::testing::FloatBits(s) == cuda::testing::FloatBits(ref.scales[i]));
    }
  }
}

TEST_CASE("fp8 overlap: pieces published one by one are quantized as they land", "[store][fp8]") {
  Model early;
  const auto tensors = early.Fill(1);
  // Three of four buffers: w0, w1, w2 are quantized now, and x's first band (rows 0-127, in
  // buffers 0 and 1); w3 and x's second band (buffers 2 and 3) wait. Nothing is visible.
  for (int k = 0; k < 3; ++k) REQUIRE(early.store.Publish("m", 1, {early.src_ids[k]}).ok());
  REQUIRE(early.WaitForQuantized(3.5 * kElements));
  std::this_thread::sleep_for(milliseconds(50));
  CHECK(early.metrics.Get(kQuantizedValues) == 3.5 * kElements);
  CHECK(early.store.LatestVersion("m") == 0);
  auto waited = early.store.WaitForVersion("m", 1, Clock::now() + milliseconds(20), nullptr);
  CHECK(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(early.store.Apply("m", 1, {early.dst_id}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  REQUIRE(early.store.Publish("m", 1, {early.src_ids[3]}).ok());
  REQUIRE(early.store.WaitForVersion("m", 1, Clock::now() + milliseconds(10000), nullptr).ok());
  // Every value quantized exactly once, early or at completion.
  CHECK(early.metrics.Get(kQuantizedValues) == 5.0 * kElements);
  const std::vector<uint8_t> got = early.Applied(1);
  RequireReference(got, tensors);

  // The same version published at once (quantized after the fact): the same bytes.
  Model late;
  late.Fill(1);
  REQUIRE(late.store.Publish("m", 1, late.src_ids).ok());
  REQUIRE(late.store.WaitForVersion("m", 1, Clock::now() + milliseconds(10000), nullptr).ok());
  CHECK(late.Applied(1) == got);
}

TEST_CASE("fp8 overlap: a version overtaken while partly quantized leaves nothing behind",
          "[store][fp8]") {
  Model m;
  m.Fill(1);
  for (int k = 0; k < 2; ++k) REQUIRE(m.store.Publish("m", 1, {m.src_ids[k]}).ok());
  REQUIRE(m.WaitForQuantized(2.5 * kElements));  // w0, w1 and x's first band of version 1
  // Version 2, other values, from every buffer at once: version 1 can never complete now.
  const auto tensors = m.Fill(2);
  REQUIRE(m.store.Publish("m", 2, m.src_ids).ok());
  REQUIRE(m.store.WaitForVersion("m", 2, Clock::now() + milliseconds(10000), nullptr).ok());
  CHECK(m.store.LatestVersion("m") == 2);
  RequireReference(m.Applied(2), tensors);
  CHECK(!m.store.Apply("m", 1, {m.dst_id}).ok());  // never complete here
}

TEST_CASE("fp8 overlap: a pulled version is quantized from the full bytes the pull delivers",
          "[store][fp8]") {
  // This node holds only the engine; the trainer is another node. The data plane hands over
  // full pieces (a delta already applied to the held base); quantization starts only then.
  Metrics metrics;
  StoreOptions options = Options();
  options.node = "engine";
  std::vector<PullJob> jobs;
  refit::testing::PullRecorder recorder(&jobs);  // outlives the store
  Store store(options, &metrics);
  store.AddListener(&recorder);
  uint8_t* dst;
  TensorSlice q = Slice("w", DType::kFP8E4M3, {kRows, kCols}, {}, {}, 0);
  q.scale_tensor = "w_scale_inv";
  q.scale_block = {128, 128};
  auto dst_id = store.RegisterBuffer(
      "m", Role::kDestination, Host(kElements + 4 * kScales, &dst),
      {q, Slice("w_scale_inv", DType::kFP32, {2, 3}, {}, {}, kElements)}, "engine");
  REQUIRE(dst_id.ok());
  TensorSlice w = Slice("w", DType::kBF16, {kRows, kCols}, {0, 0}, {kRows, kCols}, 0);
  w.buffer_strides = {kCols, 1};
  store.SetRemoteSources(
      "trainer", "m",
      {{"trainer-1", std::make_shared<std::vector<TensorSlice>>(std::vector<TensorSlice>{w}),
        kElements * 2}});
  for (uint64_t v = 1; v <= 2; ++v) {
    store.AnnounceRemoteVersion("trainer", "m", v, {{"trainer-1", "key", kElements * 2}},
                                {{"trainer-1", v - 1, v, "delta-key", 100}});
    REQUIRE(jobs.size() == v);
    if (v == 2) CHECK(jobs.back().fetches.at(0).base != nullptr);  // a delta was offered
    CHECK(metrics.Get(kQuantizedValues) == (v - 1) * static_cast<double>(kElements));
    const std::vector<uint16_t> x = RandomBf16(kElements, 100 + v);
    auto slot = store.AcquireSlot(kElements * 2);
    REQUIRE(slot.ok());
    std::memcpy((*slot)->data(), x.data(), kElements * 2);
    store.FinishPull(jobs.back(), absl::OkStatus(), {*slot});
    jobs.back().fetches[0].base.reset();
    REQUIRE(store.WaitForVersion("m", v, Clock::now() + milliseconds(10000), nullptr).ok());
    CHECK(metrics.Get(kQuantizedValues) == v * static_cast<double>(kElements));
    REQUIRE(store.Apply("m", v, {*dst_id}).ok());
    std::vector<uint8_t> got(dst, dst + kElements + 4 * kScales);
    std::vector<uint8_t> want = Reference(x.data(), kRows, kCols).q;
    want.resize(kElements + 4 * kScales);
    std::memcpy(want.data() + kElements, Reference(x.data(), kRows, kCols).scales.data(),
                4 * kScales);
    REQUIRE(got == want);
  }
}

TEST_CASE("fp8 batching: 20,000 small tensors are a few tasks, each value quantized once",
          "[store][fp8]") {
  // The unit: one piece of 20,000 [128, 41] bf16 tensors, all fp8 with [128, 128] blocks.
  const int64_t n = 20000, rows = 128, cols = 41;
  std::vector<TensorSlice> source, dest;
  for (int64_t t = 0; t < n; ++t) {
    const std::string name = "t" + std::to_string(t);
    TensorSlice s = Slice(name, DType::kBF16, {rows, cols}, {0, 0}, {rows, cols},
                          static_cast<uint64_t>(t * rows * cols * 2));
    s.buffer_strides = {cols, 1};
    source.push_back(s);
    TensorSlice q = s;
    q.dtype = DType::kFP8E4M3;
    q.scale_tensor = name + ".s";
    q.scale_block = {128, 128};
    dest.push_back(q);
  }
  std::vector<const TensorSlice*> scaled;
  for (const TensorSlice& q : dest) scaled.push_back(&q);
  auto batch = QuantBatch::Make(scaled, {&source});
  REQUIRE(batch->jobs().size() == static_cast<size_t>(n));
  CHECK(batch->bands().size() == static_cast<size_t>(n));
  const uint64_t bytes = n * rows * cols * 2;
  CHECK(batch->tasks().size() <= bytes / (4 << 20) + 1);
  for (size_t j = 0; j < batch->jobs().size(); ++j) REQUIRE(batch->job_error(j).ok());

  // Through the store: the bytes of the reference, every value quantized once per version.
  Metrics metrics;
  Store store(Options(), &metrics);
  uint8_t* src;
  auto src_id = store.RegisterBuffer("m", Role::kSource, Host(bytes, &src), source, "trainer");
  REQUIRE(src_id.ok());
  const std::vector<uint16_t> x = RandomBf16(n * rows * cols, 9);
  std::memcpy(src, x.data(), bytes);
  std::vector<TensorSlice> dst_slices;
  const uint64_t q_bytes = n * rows * cols;
  for (int64_t t = 0; t < n; ++t) {
    TensorSlice q = dest[t];
    q.buffer_offset = static_cast<uint64_t>(t * rows * cols);
    dst_slices.push_back(q);
    dst_slices.push_back(Slice(q.scale_tensor, DType::kFP32, {1, 1}, {}, {}, q_bytes + 4 * t));
  }
  uint8_t* dst;
  auto dst_id =
      store.RegisterBuffer("m", Role::kDestination, Host(q_bytes + 4 * n, &dst), dst_slices, "e");
  REQUIRE(dst_id.ok());
  for (uint64_t v = 1; v <= 2; ++v) {
    REQUIRE(store.Publish("m", v, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", v, Clock::now() + milliseconds(30000), nullptr).ok());
    CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(v * n * rows * cols));
    REQUIRE(store.Apply("m", v, {*dst_id}).ok());
  }
  for (int64_t t : {int64_t{0}, int64_t{1}, n / 2, n - 1}) {
    INFO("tensor " << t);
    const auto ref = Reference(x.data() + t * rows * cols, rows, cols);
    REQUIRE(std::vector<uint8_t>(dst + t * rows * cols, dst + (t + 1) * rows * cols) == ref.q);
    float s;
    std::memcpy(&s, dst + q_bytes + 4 * t, 4);
    REQUIRE(cuda::testing::FloatBits(s) == cuda::testing::FloatBits(ref.scales[0]));
  }
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("fp8 overlap: a pulled version is quantized block by block as its bytes land",
          "[store][fp8]") {
  // Three bf16 tensors of 4 MiB in the trainer's one piece: three quantization tasks. As the
  // pull lands the piece's bytes, each task runs once the bytes it reads are all there; a range
  // fetched again (its checksum failed) has its blocks quantized again from the new bytes; the
  // version becomes visible only when FinishPull completes it, with the bytes of quantizing
  // what passed.
  constexpr int64_t rows = 2048, cols = 1024;
  constexpr uint64_t elements = rows * cols, tensor_bytes = 2 * elements;
  constexpr uint64_t scales = (rows / 128) * (cols / 128);
  Metrics metrics;
  StoreOptions options = Options();
  options.node = "engine";
  std::vector<PullJob> jobs;
  refit::testing::PullRecorder recorder(&jobs);
  Store store(options, &metrics);
  store.AddListener(&recorder);
  uint8_t* dst;
  std::vector<TensorSlice> dst_slices;
  std::vector<TensorSlice> src_slices;
  for (uint64_t t = 0; t < 3; ++t) {
    const std::string name = "w" + std::to_string(t);
    TensorSlice q = Slice(name, DType::kFP8E4M3, {rows, cols}, {}, {}, t * elements);
    q.scale_tensor = name + "_scale_inv";
    q.scale_block = {128, 128};
    dst_slices.push_back(q);
    dst_slices.push_back(Slice(name + "_scale_inv", DType::kFP32, {rows / 128, cols / 128}, {}, {},
                               3 * elements + t * 4 * scales));
    TensorSlice w = Slice(name, DType::kBF16, {rows, cols}, {0, 0}, {rows, cols}, t * tensor_bytes);
    w.buffer_strides = {cols, 1};
    src_slices.push_back(w);
  }
  auto dst_id = store.RegisterBuffer("m", Role::kDestination,
                                     Host(3 * elements + 12 * scales, &dst), dst_slices, "engine");
  REQUIRE(dst_id.ok());
  store.SetRemoteSources(
      "trainer", "m",
      {{"trainer-1", std::make_shared<std::vector<TensorSlice>>(src_slices), 3 * tensor_bytes}});
  REQUIRE(store.QuantizesWhilePulling("m"));
  store.AnnounceRemoteVersion("trainer", "m", 1, {{"trainer-1", "key", 3 * tensor_bytes}}, {});
  REQUIRE(jobs.size() == 1);
  const PullJob& job = jobs.back();
  auto slot = store.AcquireSlot(3 * tensor_bytes);
  REQUIRE(slot.ok());
  std::vector<std::vector<uint16_t>> x;
  for (uint64_t t = 0; t < 3; ++t) x.push_back(RandomBf16(elements, 300 + t));
  uint8_t* staged = (*slot)->data();
  std::memset(staged, 0x3c, tensor_bytes);  // tensor 0 lands wrong first
  std::memcpy(staged + tensor_bytes, x[1].data(), tensor_bytes);
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  // Tensor 0 and part of tensor 1 landed: only tensor 0's task can run.
  store.QuantizeLanded(job, {*slot}, {Ranges{{0, tensor_bytes + 4096}}}, {});
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(elements));
  // Tensor 1 landed too.
  store.QuantizeLanded(job, {*slot}, {Ranges{{0, 2 * tensor_bytes}}}, {});
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(2 * elements));
  CHECK(store.LatestVersion("m") == 0);  // nothing visible while the pull runs
  // Tensor 0's bytes failed their checksum and were fetched again; tensor 2 landed.
  std::memcpy(staged, x[0].data(), tensor_bytes);
  std::memcpy(staged + 2 * tensor_bytes, x[2].data(), tensor_bytes);
  // One task (~4 MiB of source: a tensor here) per call, so that the landed-bytes quantizer
  // never holds the CPU long: two runnable (tensor 0 again, tensor 2), one run, one left.
  CHECK(
      store.QuantizeLanded(job, {*slot}, {Ranges{{0, 3 * tensor_bytes}}}, {Ranges{{4096, 8192}}}));
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(3 * elements));
  CHECK_FALSE(store.QuantizeLanded(job, {*slot}, {Ranges{{0, 3 * tensor_bytes}}}, {}));
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(4 * elements));
  CHECK(store.LatestVersion("m") == 0);
  store.FinishPull(job, absl::OkStatus(), {*slot});
  REQUIRE(store.WaitForVersion("m", 1, Clock::now() + milliseconds(10000), nullptr).ok());
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(4 * elements));  // nothing left
  REQUIRE(store.Apply("m", 1, {*dst_id}).ok());
  for (uint64_t t = 0; t < 3; ++t) {
    INFO("tensor " << t);
    const auto ref = Reference(x[t].data(), rows, cols);
    REQUIRE(std::vector<uint8_t>(dst + t * elements, dst + (t + 1) * elements) == ref.q);
    std::vector<float> got(scales);
    std::memcpy(got.data(), dst + 3 * elements + t * 4 * scales, 4 * scales);
    for (uint64_t i = 0; i < scales; ++i) {
      REQUIRE(cuda::testing::FloatBits(got[i]) == cuda::testing::FloatBits(ref.scales[i]));
    }
  }
}

TEST_CASE("fp8 overlap: a failed pull leaves no blocks quantized as they landed", "[store][fp8]") {
  Metrics metrics;
  StoreOptions options = Options();
  options.node = "engine";
  std::vector<PullJob> jobs;
  refit::testing::PullRecorder recorder(&jobs);
  Store store(options, &metrics);
  store.AddListener(&recorder);
  uint8_t* dst;
  TensorSlice q = Slice("w", DType::kFP8E4M3, {kRows, kCols}, {}, {}, 0);
  q.scale_tensor = "w_scale_inv";
  q.scale_block = {128, 128};
  auto dst_id = store.RegisterBuffer(
      "m", Role::kDestination, Host(kElements + 4 * kScales, &dst),
      {q, Slice("w_scale_inv", DType::kFP32, {2, 3}, {}, {}, kElements)}, "engine");
  REQUIRE(dst_id.ok());
  TensorSlice w = Slice("w", DType::kBF16, {kRows, kCols}, {0, 0}, {kRows, kCols}, 0);
  w.buffer_strides = {kCols, 1};
  store.SetRemoteSources(
      "trainer", "m",
      {{"trainer-1", std::make_shared<std::vector<TensorSlice>>(std::vector<TensorSlice>{w}),
        kElements * 2}});
  store.AnnounceRemoteVersion("trainer", "m", 1, {{"trainer-1", "key", kElements * 2}}, {});
  REQUIRE(jobs.size() == 1);
  auto slot = store.AcquireSlot(kElements * 2);
  REQUIRE(slot.ok());
  std::memset((*slot)->data(), 0x3c, kElements * 2);
  store.QuantizeLanded(jobs[0], {*slot}, {{{0, kElements * 2}}}, {});
  CHECK(metrics.Get(kQuantizedValues) == static_cast<double>(kElements));
  store.FinishPull(jobs[0], absl::DataLossError("checksums"), {});
  CHECK(store.LatestVersion("m") == 0);
  // The next version quantizes all of its own bytes: nothing of the failed one is reused.
  store.AnnounceRemoteVersion("trainer", "m", 2, {{"trainer-1", "key", kElements * 2}}, {});
  REQUIRE(jobs.size() == 2);
  const std::vector<uint16_t> x = RandomBf16(kElements, 77);
  auto slot2 = store.AcquireSlot(kElements * 2);
  REQUIRE(slot2.ok());
  std::memcpy((*slot2)->data(), x.data(), kElements * 2);
  store.FinishPull(jobs[1], absl::OkStatus(), {*slot2});
  REQUIRE(store.WaitForVersion("m", 2, Clock::now() + milliseconds(10000), nullptr).ok());
  REQUIRE(store.Apply("m", 2, {*dst_id}).ok());
  REQUIRE(std::vector<uint8_t>(dst, dst + kElements) == Reference(x.data(), kRows, kCols).q);
}

}  // namespace
}  // namespace refit
