// The transfer logic behind cuda::Copy and cuda::ExecutePlan, without a GPU: regions of host
// memory pose as CUDA memory on "devices" 0 and 1, and QueuedOps stands in for streams and
// kernels, as asynchronous as CUDA's. Every plan must write exactly what plan::ExecuteOnHost
// writes, whatever the places, and however small the staging. Also the host fallback's answers.

#include "cuda/transfer.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/cuda.h"
#include "cuda/kernels_testing.h"
#include "daemon/plan/plan.h"

namespace refit::cuda {
namespace {

using testing::HostBackedRegion;

// DeviceOps that behave like CUDA streams (transfer.h): work touching a "device" is only queued,
// per stream, and happens at the next Synchronize(), which drains the streams in a random order;
// host-only work happens at once; scratch starts out as garbage. A step that reads bytes before
// the queued work delivering them is known to be done reads the wrong ones, so the plans' bytes
// no longer match ExecuteOnHost's. The CPU kernels (HostMemoryOps) do the actual work.
class QueuedOps final : public internal::DeviceOps {
 public:
  explicit QueuedOps(uint64_t seed) : rng_(seed) {}

  absl::Status Convert(internal::Place place, const uint8_t* src, DType src_dtype, uint8_t* dst,
                       DType dst_dtype, const ElementRun& run) override {
    if (place == internal::kHost) return host_.Convert(place, src, src_dtype, dst, dst_dtype, run);
    streams_[place].push_back(
        [=] { return host_.Convert(place, src, src_dtype, dst, dst_dtype, run); });
    return absl::OkStatus();
  }

  absl::Status Copy2D(internal::Place dst_place, uint8_t* dst, uint64_t dst_pitch,
                      internal::Place src_place, const uint8_t* src, uint64_t src_pitch,
                      uint64_t row_bytes, uint64_t rows) override {
    auto copy = [=] {
      return host_.Copy2D(dst_place, dst, dst_pitch, src_place, src, src_pitch, row_bytes, rows);
    };
    if (dst_place == internal::kHost && src_place == internal::kHost) return copy();
    streams_[dst_place != internal::kHost ? dst_place : src_place].push_back(copy);
    return absl::OkStatus();
  }

  absl::StatusOr<uint8_t*> Scratch(internal::Place place, int slot, uint64_t bytes) override {
    std::unique_ptr<testing::Bytes>& buffer = scratch_[{place, slot}];
    if (!buffer || buffer->size() < bytes) {
      // Queued work may still point into the old buffer: it goes at the next Synchronize().
      if (buffer) retired_.push_back(std::move(buffer));
      buffer = std::make_unique<testing::Bytes>(testing::RandomBytes(bytes, rng_()));
    }
    return buffer->data();
  }

  absl::Status Synchronize() override {
    std::vector<internal::Place> order;
    for (const auto& [place, work] : streams_) order.push_back(place);
    std::shuffle(order.begin(), order.end(), rng_);
    absl::Status first = absl::OkStatus();
    for (const internal::Place place : order) {
      for (const auto& work : streams_[place]) {
        const absl::Status status = work();
        if (first.ok()) first = status;
      }
    }
    streams_.clear();
    retired_.clear();
    return first;
  }

  // Queued work not yet run: 0 after every call that returned.
  size_t pending() const {
    size_t n = 0;
    for (const auto& [place, work] : streams_) n += work.size();
    return n;
  }
  uint64_t cross_place_copies() const { return host_.cross_place_copies(); }

 private:
  internal::HostMemoryOps host_;
  std::mt19937_64 rng_;
  std::map<internal::Place, std::vector<std::function<absl::Status()>>> streams_;
  std::map<std::pair<internal::Place, int>, std::unique_ptr<testing::Bytes>> scratch_;
  std::vector<std::unique_ptr<testing::Bytes>> retired_;
};

std::unique_ptr<Region> Make(internal::Place place, uint64_t size, uint64_t seed) {
  auto region = std::make_unique<HostBackedRegion>(
      place == internal::kHost ? MemoryKind::kHost : MemoryKind::kCuda, place, size);
  const testing::Bytes bytes = testing::RandomBytes(size, seed);
  std::copy(bytes.begin(), bytes.end(), region->data());
  return region;
}

uint64_t Extent(uint64_t count, uint64_t rows, int64_t stride, int64_t row_stride, DType dtype) {
  return ((rows - 1) * static_cast<uint64_t>(row_stride) +
          (count - 1) * static_cast<uint64_t>(stride) + 1) *
         DTypeSize(dtype);
}

// A random plan: ops of every kind (contiguous, pitched rows, strided either side, converting,
// multi-row), each writing its own destination location, reading one of a few sources.
struct RandomPlan {
  plan::Plan plan;
  std::vector<uint64_t> src_sizes, dst_sizes;
};

RandomPlan MakePlan(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const DType floats[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3,
                          DType::kFP8E5M2};
  RandomPlan out;
  out.src_sizes.assign(3, 0);
  for (uint32_t i = 0; i < 40; ++i) {
    plan::CopyOp op;
    op.src_dtype = floats[rng() % 5];
    op.dst_dtype = rng() % 2 ? op.src_dtype : floats[rng() % 5];
    op.count = 1 + rng() % 300;
    op.rows = rng() % 3 ? 1 + rng() % 20 : 1;
    op.src_stride = rng() % 3 ? 1 : 1 + static_cast<int64_t>(rng() % 4);
    op.dst_stride = rng() % 3 ? 1 : 1 + static_cast<int64_t>(rng() % 4);
    const int64_t count = static_cast<int64_t>(op.count);
    op.src_row_stride = op.rows > 1 ? count * op.src_stride + static_cast<int64_t>(rng() % 50) : 0;
    op.dst_row_stride = op.rows > 1 ? count * op.dst_stride + static_cast<int64_t>(rng() % 50) : 0;
    op.src_location = static_cast<uint32_t>(rng() % 3);
    op.src_offset = rng() % 1000;
    op.dst_location = i;
    op.dst_offset = rng() % 100;
    const uint64_t src_end =
        op.src_offset + Extent(op.count, op.rows, op.src_stride, op.src_row_stride, op.src_dtype);
    out.src_sizes[op.src_location] = std::max(out.src_sizes[op.src_location], src_end);
    out.dst_sizes.push_back(
        op.dst_offset + Extent(op.count, op.rows, op.dst_stride, op.dst_row_stride, op.dst_dtype) +
        7);
    out.plan.ops.push_back(op);
  }
  return out;
}

TEST_CASE("plans across host and device places write what ExecuteOnHost writes", "[transfer]") {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const RandomPlan p = MakePlan(seed);
    std::mt19937_64 rng(seed * 977);
    // Each location on the host or on device 0 or 1.
    auto place = [&] { return static_cast<internal::Place>(rng() % 3) - 1; };
    std::vector<std::unique_ptr<Region>> src, dst, want;
    for (size_t i = 0; i < p.src_sizes.size(); ++i)
      src.push_back(Make(place(), p.src_sizes[i], seed * 100 + i));
    for (size_t i = 0; i < p.dst_sizes.size(); ++i) {
      dst.push_back(Make(place(), p.dst_sizes[i], seed * 1000 + i));
      want.push_back(Make(internal::kHost, p.dst_sizes[i], seed * 1000 + i));
    }
    std::vector<const Region*> src_regions, dst_regions;
    std::vector<const uint8_t*> src_data;
    std::vector<uint8_t*> want_data;
    for (auto& r : src) src_regions.push_back(r.get()), src_data.push_back(r->data());
    for (auto& r : dst) dst_regions.push_back(r.get());
    for (auto& r : want) want_data.push_back(r->data());
    plan::ExecuteOnHost(p.plan, src_data, want_data);

    for (const uint64_t staging : {uint64_t{1}, uint64_t{96}, uint64_t{1} << 20}) {
      // Destinations start from their original bytes each time.
      for (size_t i = 0; i < dst.size(); ++i) {
        const testing::Bytes original = testing::RandomBytes(p.dst_sizes[i], seed * 1000 + i);
        std::copy(original.begin(), original.end(), dst[i]->data());
      }
      QueuedOps ops(seed * 31 + staging);
      REQUIRE(internal::ExecutePlanWith(ops, p.plan, src_regions, dst_regions, staging).ok());
      CHECK(ops.pending() == 0);
      INFO("seed " << seed << ", staging " << staging);
      for (size_t i = 0; i < dst.size(); ++i) {
        INFO("destination " << i);
        REQUIRE(std::equal(dst[i]->data(), dst[i]->data() + dst[i]->size(), want[i]->data()));
      }
      if (staging == 1) CHECK(ops.cross_place_copies() > 0);
    }
  }
}

// The case a read of the code found racing: the bytes move from the device into host scratch on
// the device's stream, then the host scatters them into its strides.
TEST_CASE("a device-to-host op with a strided destination scatters what landed", "[transfer]") {
  for (const DType to : {DType::kBF16, DType::kFP32}) {
    plan::CopyOp op;
    op.src_dtype = DType::kBF16;
    op.dst_dtype = to;
    op.count = 1000;
    op.rows = 3;
    op.src_row_stride = 1000;
    op.dst_stride = 2;
    op.dst_row_stride = 2001;
    plan::Plan plan;
    plan.ops.push_back(op);
    auto src = Make(0, 3000 * 2, 11);
    auto dst = Make(internal::kHost, 6003 * DTypeSize(to), 12);
    testing::Bytes want(dst->data(), dst->data() + dst->size());
    plan::ExecuteOnHost(plan, {src->data()}, {want.data()});
    for (const uint64_t staging : {uint64_t{256}, uint64_t{1} << 20}) {
      QueuedOps ops(staging);
      REQUIRE(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, staging).ok());
      CHECK(ops.pending() == 0);
      CHECK(ops.cross_place_copies() > 0);
      CHECK(std::equal(want.begin(), want.end(), dst->data()));
    }
  }
}

TEST_CASE("ExecutePlanWith refuses ops outside their regions", "[transfer]") {
  auto src = Make(0, 100, 1);
  auto dst = Make(internal::kHost, 100, 2);
  plan::CopyOp op;
  op.src_dtype = op.dst_dtype = DType::kFP32;
  op.count = 25;
  plan::Plan plan;
  plan.ops.push_back(op);
  QueuedOps ops(3);
  CHECK(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, 64).ok());
  plan.ops[0].src_offset = 4;  // one element past the end
  CHECK(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, 64).code() ==
        absl::StatusCode::kInvalidArgument);
  plan.ops[0] = op;
  plan.ops[0].rows = 2;
  plan.ops[0].dst_row_stride = 25;
  CHECK(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, 64).code() ==
        absl::StatusCode::kInvalidArgument);
  plan.ops[0] = op;
  plan.ops[0].dst_location = 1;
  CHECK(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, 64).code() ==
        absl::StatusCode::kInvalidArgument);
  plan.ops[0] = op;
  plan.ops[0].src_stride = -1;
  CHECK(internal::ExecutePlanWith(ops, plan, {src.get()}, {dst.get()}, 64).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("CopyWith copies windows between places and checks both ends", "[transfer]") {
  auto a = Make(1, 1000, 1);
  auto b = Make(internal::kHost, 1000, 2);
  QueuedOps ops(7);
  REQUIRE(internal::CopyWith(ops, *b, 10, *a, 500, 490).ok());
  CHECK(ops.pending() == 0);
  CHECK(std::equal(a->data() + 500, a->data() + 990, b->data() + 10));
  CHECK(ops.cross_place_copies() == 1);
  CHECK(internal::CopyWith(ops, *b, 511, *a, 0, 490).code() == absl::StatusCode::kInvalidArgument);
  CHECK(internal::CopyWith(ops, *b, 0, *a, 511, 490).code() == absl::StatusCode::kInvalidArgument);
  CHECK(internal::CopyWith(ops, *b, ~uint64_t{0}, *a, 0, 2).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(internal::CopyWith(ops, *b, 1000, *a, 1000, 0).ok());
}

// The fallback (default build) through the public header.
TEST_CASE("host fallback: no CUDA, host copies and plans still work", "[transfer][fallback]") {
  CHECK_FALSE(CompiledIn());
  CHECK(DeviceCount() == 0);
  CHECK(Describe() == "cuda: not compiled in");
  CHECK(OpenIpc(std::string(64, 'x'), 0, 0, 0).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(AllocateDevice(4096, 0).status().code() == absl::StatusCode::kFailedPrecondition);

  auto pinned = AllocatePinnedHost(4096);
  REQUIRE(pinned.ok());
  CHECK((*pinned)->kind() == MemoryKind::kHost);
  CHECK((*pinned)->size() == 4096);
  auto source = Make(internal::kHost, 4096, 3);
  REQUIRE(Copy(**pinned, 0, *source, 0, 4096).ok());
  CHECK(std::equal(source->data(), source->data() + 4096, (*pinned)->data()));
  CHECK(Copy(**pinned, 1, *source, 0, 4096).code() == absl::StatusCode::kInvalidArgument);

  auto device = Make(0, 4096, 4);
  CHECK(Copy(*device, 0, *source, 0, 16).code() == absl::StatusCode::kFailedPrecondition);

  const RandomPlan p = MakePlan(99);
  std::vector<std::unique_ptr<Region>> src, dst;
  std::vector<const Region*> src_regions, dst_regions;
  std::vector<const uint8_t*> src_data;
  std::vector<uint8_t*> want_data;
  std::vector<testing::Bytes> want;
  for (size_t i = 0; i < p.src_sizes.size(); ++i) {
    src.push_back(Make(internal::kHost, p.src_sizes[i], i));
    src_regions.push_back(src.back().get());
    src_data.push_back(src.back()->data());
  }
  for (size_t i = 0; i < p.dst_sizes.size(); ++i) {
    dst.push_back(Make(internal::kHost, p.dst_sizes[i], 50 + i));
    dst_regions.push_back(dst.back().get());
    want.push_back(testing::RandomBytes(p.dst_sizes[i], 50 + i));
  }
  for (auto& w : want) want_data.push_back(w.data());
  plan::ExecuteOnHost(p.plan, src_data, want_data);
  REQUIRE(ExecutePlan(p.plan, src_regions, dst_regions).ok());
  for (size_t i = 0; i < dst.size(); ++i) {
    REQUIRE(std::equal(want[i].begin(), want[i].end(), dst[i]->data()));
  }
  // A plan touching CUDA memory is refused before anything is written.
  const testing::Bytes before(dst[0]->data(), dst[0]->data() + dst[0]->size());
  src_regions[2] = device.get();
  CHECK(ExecutePlan(p.plan, src_regions, dst_regions).code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(std::equal(before.begin(), before.end(), dst[0]->data()));
}

}  // namespace
}  // namespace refit::cuda
