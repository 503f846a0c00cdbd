// BuildPlan and ExecuteOnHost on the layouts trainers and engines use: tensor-parallel splits
// between degrees, pipeline stages, FSDP shards, MoE experts, fused and strided destinations,
// replicated sources, conversions and errors.

#include "daemon/plan/plan.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "catch2/catch.hpp"
#include "daemon/common/types.h"
#include "daemon/plan/plan_testing.h"

namespace refit::plan {
namespace {

using testing::Buffer;
using testing::TensorSpec;

// Plans sources -> destinations (single- and multi-row), executes both on host memory and
// checks them; returns the single-row plan.
Plan PlanAndCheck(std::vector<Buffer>& sources, std::vector<Buffer>& destinations) {
  testing::Finish(sources);
  testing::Finish(destinations);
  testing::FillSources(sources);
  const std::vector<PlacedSlice> src = testing::Place(sources);
  const std::vector<PlacedSlice> dst = testing::Place(destinations);
  PlanOptions multi;
  multi.multi_row_ops = true;
  absl::StatusOr<Plan> multi_plan = BuildPlan(src, dst, multi);
  REQUIRE(multi_plan.ok());
  REQUIRE(testing::ExecuteAndCheck(*multi_plan, sources, destinations) == "");
  absl::StatusOr<Plan> plan = BuildPlan(src, dst);
  REQUIRE(plan.ok());
  for (const CopyOp& op : plan->ops) REQUIRE(op.rows == 1);
  REQUIRE(testing::ExecuteAndCheck(*plan, sources, destinations) == "");
  CHECK(plan->src_bytes == multi_plan->src_bytes);
  CHECK(plan->dst_bytes == multi_plan->dst_bytes);
  return *plan;
}

// A model sharded `from` ways along `dim` into `to` ways, one buffer per rank.
Plan Reshard(const TensorSpec& spec, int dim, int from, int to) {
  std::vector<Buffer> sources(from);
  for (int r = 0; r < from; ++r) {
    sources[r].node = r;
    testing::Append(sources[r], testing::Shard(spec, dim, from, r));
  }
  std::vector<Buffer> destinations(to);
  for (int r = 0; r < to; ++r) testing::Append(destinations[r], testing::Shard(spec, dim, to, r));
  return PlanAndCheck(sources, destinations);
}

TEST_CASE("tensor-parallel column splits (dim 0) between degrees", "[plan][tp]") {
  const TensorSpec w{"w", DType::kBF16, {48, 20}};
  // Whole rows move: each (source, destination) pair is one op.
  CHECK(Reshard(w, 0, 8, 2).ops.size() == 8);
  CHECK(Reshard(w, 0, 4, 2).ops.size() == 4);
  CHECK(Reshard(w, 0, 2, 4).ops.size() == 4);
  CHECK(Reshard(w, 0, 1, 8).ops.size() == 8);
  CHECK(Reshard(w, 0, 1, 1).ops.size() == 1);
  // 50 rows: sources 17/17/16, destinations 25/25 -> pieces 17, 8 | 9, 16.
  const Plan uneven = Reshard({"u", DType::kFP32, {50, 3}}, 0, 3, 2);
  REQUIRE(uneven.ops.size() == 4);
  const std::vector<uint64_t> counts{17 * 3, 8 * 3, 9 * 3, 16 * 3};
  const std::vector<uint32_t> from{0, 1, 1, 2};
  const std::vector<uint64_t> src_offsets{0, 0, 8 * 3 * 4, 0};
  const std::vector<uint64_t> dst_offsets{0, 17 * 3 * 4, 0, 9 * 3 * 4};
  for (size_t i = 0; i < 4; ++i) {
    CHECK(uneven.ops[i].count == counts[i]);
    CHECK(uneven.ops[i].src_location == from[i]);
    CHECK(uneven.ops[i].src_offset == src_offsets[i]);
    CHECK(uneven.ops[i].dst_offset == dst_offsets[i]);
  }
  CHECK(uneven.src_bytes == 50 * 3 * 4);
}

TEST_CASE("tensor-parallel row splits (dim 1) between degrees", "[plan][tp]") {
  const TensorSpec w{"w", DType::kBF16, {6, 40}};
  // One op per row per (source, destination) pair in single-row plans.
  CHECK(Reshard(w, 1, 8, 2).ops.size() == 6 * 8);
  CHECK(Reshard(w, 1, 4, 2).ops.size() == 6 * 4);
  CHECK(Reshard(w, 1, 2, 4).ops.size() == 6 * 4);
  CHECK(Reshard(w, 1, 1, 8).ops.size() == 6 * 8);
  CHECK(Reshard({"u", DType::kFP16, {5, 23}}, 1, 3, 2).ops.size() == 5 * 4);
  CHECK(Reshard({"u3", DType::kFP16, {3, 5, 23}}, 2, 2, 3).ops.size() == 15 * 4);
}

TEST_CASE("multi-row ops cover a row split with one op per pair", "[plan][tp]") {
  const TensorSpec w{"w", DType::kBF16, {6, 40}};
  std::vector<Buffer> sources(4);
  for (int r = 0; r < 4; ++r) testing::Append(sources[r], testing::Shard(w, 1, 4, r));
  std::vector<Buffer> destinations(2);
  for (int r = 0; r < 2; ++r) testing::Append(destinations[r], testing::Shard(w, 1, 2, r));
  PlanAndCheck(sources, destinations);
  PlanOptions options;
  options.multi_row_ops = true;
  absl::StatusOr<Plan> plan =
      BuildPlan(testing::Place(sources), testing::Place(destinations), options);
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 4);
  // Source rank 1 -> destination rank 0, columns 10..20 of each row.
  CopyOp expected;
  expected.src_location = 1;
  expected.dst_location = 0;
  expected.dst_offset = 10 * 2;
  expected.count = 10;
  expected.rows = 6;
  expected.src_row_stride = 10;
  expected.dst_row_stride = 20;
  expected.src_dtype = DType::kBF16;
  expected.dst_dtype = DType::kBF16;
  CHECK(plan->ops[1] == expected);
}

TEST_CASE("pipeline stages into one engine buffer coalesce per stage", "[plan][pp]") {
  std::vector<TensorSpec> layers;
  for (int i = 0; i < 4; ++i) layers.push_back({"layer" + std::to_string(i), DType::kFP32, {8, 4}});
  std::vector<Buffer> sources(2);  // stage 0: layers 0-1, stage 1: layers 2-3
  sources[1].node = 1;
  std::vector<Buffer> destinations(1);
  for (int i = 0; i < 4; ++i) {
    testing::Append(sources[i / 2], testing::Whole(layers[i]));
    testing::Append(destinations[0], testing::Whole(layers[i]));
  }
  const Plan plan = PlanAndCheck(sources, destinations);
  REQUIRE(plan.ops.size() == 2);
  CHECK(plan.ops[0].count == 64);
  CHECK(plan.ops[1].src_location == 1);
  CHECK(plan.ops[1].dst_offset == 64 * 4);
}

TEST_CASE("FSDP dim-0 shards with an uneven last shard", "[plan][fsdp]") {
  const TensorSpec w{"w", DType::kBF16, {10, 6}};
  std::vector<Buffer> sources(4);
  for (int r = 0; r < 4; ++r) {
    const int64_t rows = r < 3 ? 3 : 1;
    testing::Append(sources[r], testing::Box(w, {3 * r, 0}, {rows, 6}));
  }
  std::vector<Buffer> destinations(1);
  testing::Append(destinations[0], testing::Whole(w));
  const Plan plan = PlanAndCheck(sources, destinations);
  REQUIRE(plan.ops.size() == 4);
  CHECK(plan.ops[3].count == 6);
  CHECK(plan.ops[3].dst_offset == 9 * 6 * 2);
}

TEST_CASE("MoE experts move to a different expert placement", "[plan][moe]") {
  const TensorSpec experts{"experts.w1", DType::kBF16, {8, 6, 4}};
  // Training: EP4, experts 2r and 2r + 1 on rank r. Inference: EP2 round robin, one slice per
  // expert: rank 0 holds experts 0, 2, 4, 6.
  std::vector<Buffer> sources(4);
  for (int r = 0; r < 4; ++r) testing::Append(sources[r], testing::Shard(experts, 0, 4, r));
  std::vector<Buffer> destinations(2);
  for (int e = 0; e < 8; ++e) {
    testing::Append(destinations[e % 2], testing::Box(experts, {e, 0, 0}, {1, 6, 4}));
  }
  const Plan plan = PlanAndCheck(sources, destinations);
  CHECK(plan.ops.size() == 8);
}

TEST_CASE("fused destinations: qkv and gate_up at consecutive offsets", "[plan][fused]") {
  const TensorSpec q{"q", DType::kBF16, {16, 8}};
  const TensorSpec k{"k", DType::kBF16, {4, 8}};
  const TensorSpec v{"v", DType::kBF16, {4, 8}};
  const TensorSpec gate{"gate", DType::kBF16, {12, 8}};
  const TensorSpec up{"up", DType::kBF16, {12, 8}};
  // Trainer TP4 with separate tensors; engine TP2 with qkv = [q; k; v] and gate_up per rank.
  std::vector<Buffer> sources(4);
  for (int r = 0; r < 4; ++r) {
    for (const TensorSpec* t : {&q, &k, &v, &gate, &up}) {
      testing::Append(sources[r], testing::Shard(*t, 0, 4, r));
    }
  }
  std::vector<Buffer> destinations(2);
  for (int r = 0; r < 2; ++r) {
    for (const TensorSpec* t : {&q, &k, &v, &gate, &up}) {
      testing::Append(destinations[r], testing::Shard(*t, 0, 2, r));
    }
  }
  PlanAndCheck(sources, destinations);

  // Unsharded to unsharded, same packing: the whole buffer is one op.
  std::vector<Buffer> whole_src(1);
  std::vector<Buffer> whole_dst(1);
  for (const TensorSpec* t : {&q, &k, &v}) {
    testing::Append(whole_src[0], testing::Whole(*t));
    testing::Append(whole_dst[0], testing::Whole(*t));
  }
  const Plan plan = PlanAndCheck(whole_src, whole_dst);
  REQUIRE(plan.ops.size() == 1);
  CHECK(plan.ops[0].count == 24 * 8);
}

TEST_CASE("strided destinations: column-concatenated fusion and transposed layout",
          "[plan][strided]") {
  const TensorSpec a{"a", DType::kFP16, {7, 5}};
  const TensorSpec b{"b", DType::kFP16, {7, 3}};
  std::vector<Buffer> sources(2);
  testing::Append(sources[0], testing::Shard(a, 0, 2, 0));
  testing::Append(sources[0], testing::Shard(b, 0, 2, 0));
  testing::Append(sources[1], testing::Shard(a, 0, 2, 1));
  testing::Append(sources[1], testing::Shard(b, 0, 2, 1));
  std::vector<Buffer> destinations(2);
  // [7, 8] buffer: columns 0..5 are a, 5..8 are b.
  testing::AppendColumnFused(destinations[0], {testing::Whole(a), testing::Whole(b)});
  // a transposed: element (i, j) at j * 7 + i.
  testing::AppendStrided(destinations[1], testing::Whole(a, DType::kFP32), {1, 0}, {0, 0});
  const Plan plan = PlanAndCheck(sources, destinations);
  // Fused: 7 rows x 2 tensors. Transposed: each source row becomes a strided destination run.
  CHECK(plan.ops.size() == 7 * 2 + 7);
  for (const CopyOp& op : plan.ops) {
    if (op.dst_location == 1) {
      CHECK(op.count == 5);
      CHECK(op.src_stride == 1);
      CHECK(op.dst_stride == 7);
      CHECK(op.dst_dtype == DType::kFP32);
    }
  }
}

TEST_CASE("replicated sources: each element copied once, load spread over nodes",
          "[plan][replicas]") {
  const TensorSpec norm{"norm", DType::kFP32, {64}};
  const TensorSpec w{"w", DType::kFP32, {16, 4}};
  std::vector<Buffer> sources(4);  // every node holds everything
  for (int r = 0; r < 4; ++r) {
    sources[r].node = r;
    testing::Append(sources[r], testing::Whole(norm));
    testing::Append(sources[r], testing::Whole(w));
  }
  std::vector<Buffer> destinations(8);  // 8 engines, each wants everything
  for (int r = 0; r < 8; ++r) {
    testing::Append(destinations[r], testing::Whole(norm));
    testing::Append(destinations[r], testing::Whole(w));
  }
  const Plan plan = PlanAndCheck(sources, destinations);
  std::map<uint32_t, uint64_t> per_node;
  for (const CopyOp& op : plan.ops) per_node[op.src_location] += op.count * 4;
  REQUIRE(per_node.size() == 4);
  for (const auto& [node, bytes] : per_node) CHECK(bytes == 2 * (64 + 64) * 4);

  // With a local node, its replica serves everything.
  PlanOptions local;
  local.local_node = 2;
  absl::StatusOr<Plan> local_plan =
      BuildPlan(testing::Place(sources), testing::Place(destinations), local);
  REQUIRE(local_plan.ok());
  for (const CopyOp& op : local_plan->ops) CHECK(op.src_location == 2);
  REQUIRE(testing::ExecuteAndCheck(*local_plan, sources, destinations) == "");
}

TEST_CASE("replicas covering different parts: box difference picks up the rest",
          "[plan][replicas]") {
  const TensorSpec w{"w", DType::kINT32, {9, 9}};
  std::vector<Buffer> sources(3);
  testing::Append(sources[0], testing::Box(w, {2, 2}, {5, 5}));  // the middle
  testing::Append(sources[1], testing::Box(w, {0, 0}, {9, 5}));  // left columns
  testing::Append(sources[2], testing::Whole(w));
  sources[1].node = 1;
  sources[2].node = 2;
  std::vector<Buffer> destinations(2);
  testing::Append(destinations[0], testing::Whole(w));
  testing::Append(destinations[1], testing::Box(w, {1, 1}, {7, 7}));
  PlanAndCheck(sources, destinations);
}

TEST_CASE("dtype conversion on the way", "[plan][convert]") {
  const TensorSpec w{"w", DType::kBF16, {6, 10}};
  std::vector<Buffer> sources(2);
  for (int r = 0; r < 2; ++r) testing::Append(sources[r], testing::Shard(w, 1, 2, r));
  std::vector<Buffer> destinations(2);
  testing::Append(destinations[0], testing::Whole(w, DType::kFP32));
  testing::Append(destinations[1], testing::Whole(w, DType::kFP16));
  const Plan plan = PlanAndCheck(sources, destinations);
  CHECK(plan.src_bytes == 2 * 60 * 2);
  CHECK(plan.dst_bytes == 60 * 4 + 60 * 2);
}

TEST_CASE("uncovered regions and missing tensors are FAILED_PRECONDITION", "[plan][errors]") {
  const TensorSpec w{"layers.0.w", DType::kFP32, {8, 4}};
  TensorSlice top = testing::Box(w, {0, 0}, {6, 4});
  TensorSlice corner = testing::Box(w, {6, 0}, {2, 2});
  corner.buffer_offset = 6 * 4 * 4;
  std::vector<TensorSlice> src{top, corner};
  REQUIRE(NormalizeAndValidateBuffer(src, 1 << 10).ok());
  std::vector<TensorSlice> dst{testing::Whole(w)};
  REQUIRE(NormalizeAndValidateBuffer(dst, 1 << 10).ok());
  absl::StatusOr<Plan> plan = BuildPlan({{&src[0], 0, 0}, {&src[1], 0, 0}}, {{&dst[0], 0, 0}});
  REQUIRE(plan.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(plan.status().message()) ==
        "tensor layers.0.w: destination region [6:8, 2:4] is not covered by any source");

  std::vector<TensorSlice> other{testing::Whole({"other", DType::kFP32, {3}})};
  REQUIRE(NormalizeAndValidateBuffer(other, 1 << 10).ok());
  plan = BuildPlan({{&src[0], 0, 0}}, {{&other[0], 0, 0}});
  REQUIRE(plan.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(plan.status().message()).find("other") != std::string::npos);
}

TEST_CASE("disagreeing shapes and dtypes are INVALID_ARGUMENT", "[plan][errors]") {
  const TensorSpec w{"w", DType::kBF16, {4, 4}};
  std::vector<TensorSlice> s{testing::Shard(w, 0, 2, 0), testing::Shard(w, 0, 2, 1)};
  s[1].buffer_offset = 64;
  s[1].dtype = DType::kFP16;
  std::vector<TensorSlice> d{testing::Whole(w)};
  REQUIRE(NormalizeAndValidateBuffer(d, 1 << 10).ok());
  s[1].dtype = DType::kBF16;
  REQUIRE(NormalizeAndValidateBuffer(s, 1 << 10).ok());
  s[1].dtype = DType::kFP16;
  auto code = [&](const std::vector<TensorSlice>& src, const std::vector<TensorSlice>& dst) {
    std::vector<PlacedSlice> ps;
    for (const TensorSlice& x : src) ps.push_back({&x, 0, 0});
    std::vector<PlacedSlice> pd;
    for (const TensorSlice& x : dst) pd.push_back({&x, 0, 0});
    return BuildPlan(ps, pd).status().code();
  };
  CHECK(code(s, d) == absl::StatusCode::kInvalidArgument);  // sources disagree on dtype
  s[1].dtype = DType::kBF16;
  CHECK(code(s, d) == absl::StatusCode::kOk);
  s[1].global_shape = {4, 5};
  CHECK(code(s, d) == absl::StatusCode::kInvalidArgument);  // sources disagree on shape
  s[1].global_shape = {4, 4};
  d[0].global_shape = {4, 8};
  CHECK(code(s, d) == absl::StatusCode::kInvalidArgument);  // destination shape differs
  d[0].global_shape = {4, 4};
  d[0].dtype = DType::kINT8;
  CHECK(code(s, d) == absl::StatusCode::kInvalidArgument);  // bf16 -> int8
  d[0].dtype = DType::kFP8E4M3;
  CHECK(code(s, d) == absl::StatusCode::kOk);
  TensorSlice bad = d[0];
  bad.sizes.clear();  // not normalized
  CHECK(code(s, {bad}) == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("plans are deterministic", "[plan]") {
  const TensorSpec w{"w", DType::kBF16, {30, 30}};
  std::vector<Buffer> sources(6);
  for (int r = 0; r < 6; ++r) {
    sources[r].node = r % 3;
    testing::Append(sources[r], testing::Shard(w, r % 2, 2, r / 3));
  }
  std::vector<Buffer> destinations(3);
  for (int r = 0; r < 3; ++r) testing::Append(destinations[r], testing::Shard(w, 1, 3, r));
  PlanAndCheck(sources, destinations);
  const auto src = testing::Place(sources);
  const auto dst = testing::Place(destinations);
  absl::StatusOr<Plan> first = BuildPlan(src, dst);
  absl::StatusOr<Plan> second = BuildPlan(src, dst);
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->ops == second->ops);
}

TEST_CASE("the checker catches lost, doubled and misplaced copies", "[plan][testing]") {
  const TensorSpec w{"w", DType::kFP32, {8, 4}};
  std::vector<Buffer> sources(2);
  for (int r = 0; r < 2; ++r) testing::Append(sources[r], testing::Shard(w, 0, 2, r));
  std::vector<Buffer> destinations(1);
  testing::Append(destinations[0], testing::Whole(w));
  const Plan good = PlanAndCheck(sources, destinations);
  Plan lost = good;
  lost.ops.back().count -= 1;
  lost.src_bytes -= 4;
  lost.dst_bytes -= 4;
  CHECK(testing::ExecuteAndCheck(lost, sources, destinations) != "");
  Plan doubled = good;
  doubled.ops[1].dst_offset -= 4;
  CHECK(testing::ExecuteAndCheck(doubled, sources, destinations) != "");
  Plan swapped = good;
  swapped.ops[1].src_location = 0;
  CHECK(testing::ExecuteAndCheck(swapped, sources, destinations) != "");
}

TEST_CASE("whole-tensor models plan to one op per tensor, without iterating rows",
          "[plan][scale]") {
  // ~1 GiB of bf16 in 64 tensors, each in its own source buffer.
  std::vector<std::vector<TensorSlice>> src(64);
  std::vector<TensorSlice> dst;
  uint64_t offset = 0;
  for (int i = 0; i < 64; ++i) {
    TensorSlice s;
    s.name = "t" + std::to_string(i);
    s.dtype = DType::kBF16;
    s.global_shape = {1000000 / 8 + i, 64};
    const uint64_t bytes = static_cast<uint64_t>(s.global_shape[0]) * 64 * 2;
    src[i].push_back(s);
    REQUIRE(NormalizeAndValidateBuffer(src[i], bytes).ok());
    s.buffer_offset = offset;
    offset += bytes;
    dst.push_back(s);
  }
  // Sources live in different locations, so consecutive destination runs do not merge.
  std::vector<PlacedSlice> sources;
  std::vector<PlacedSlice> destinations;
  REQUIRE(NormalizeAndValidateBuffer(dst, offset).ok());
  for (int i = 0; i < 64; ++i) {
    sources.push_back({&src[i][0], static_cast<uint32_t>(i), 0});
    destinations.push_back({&dst[i], 0, 0});
  }
  absl::StatusOr<Plan> plan = BuildPlan(sources, destinations);
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 64);
  CHECK(plan->ops[3].count == (1000000 / 8 + 3) * 64);
  CHECK(plan->dst_bytes == offset);

  // [1M, 64] both sides contiguous but different boxes: still one op per intersection.
  const TensorSpec big{"big", DType::kBF16, {1000000, 64}};
  std::vector<TensorSlice> halves{testing::Shard(big, 0, 2, 0)};
  std::vector<TensorSlice> other{testing::Shard(big, 0, 2, 1)};
  std::vector<TensorSlice> whole{testing::Whole(big)};
  REQUIRE(NormalizeAndValidateBuffer(halves, 64000000).ok());
  REQUIRE(NormalizeAndValidateBuffer(other, 64000000).ok());
  REQUIRE(NormalizeAndValidateBuffer(whole, 128000000).ok());
  plan = BuildPlan({{&halves[0], 0, 0}, {&other[0], 1, 1}}, {{&whole[0], 0, 0}});
  REQUIRE(plan.ok());
  CHECK(plan->ops.size() == 2);
}

TEST_CASE("thousands of FSDP shards in scrambled order plan quickly", "[plan][scale]") {
  // 4096 shards of 2 rows, listed in a scrambled order, into 3 whole replicas and 5 TP pieces.
  const TensorSpec w{"w", DType::kBF16, {8192, 16}};
  std::vector<TensorSlice> shards;
  for (int r = 0; r < 4096; ++r)
    shards.push_back(testing::Box(w, {2 * ((r * 2654435761u) % 4096), 0}, {2, 16}));
  std::vector<std::vector<TensorSlice>> src(shards.size());
  std::vector<PlacedSlice> sources;
  for (size_t i = 0; i < shards.size(); ++i) {
    src[i] = {shards[i]};
    REQUIRE(NormalizeAndValidateBuffer(src[i], 64).ok());
    sources.push_back({&src[i][0], static_cast<uint32_t>(i), static_cast<uint32_t>(i)});
  }
  std::vector<std::vector<TensorSlice>> dst;
  for (int r = 0; r < 3; ++r) dst.push_back({testing::Whole(w)});
  for (int r = 0; r < 5; ++r) dst.push_back({testing::Shard(w, 0, 5, r)});
  std::vector<PlacedSlice> destinations;
  for (size_t i = 0; i < dst.size(); ++i) {
    REQUIRE(NormalizeAndValidateBuffer(dst[i], 8192 * 16 * 2).ok());
    destinations.push_back({&dst[i][0], static_cast<uint32_t>(i), 0});
  }
  absl::StatusOr<Plan> plan = BuildPlan(sources, destinations);
  REQUIRE(plan.ok());
  // Each whole replica takes one op per shard; the pieces (rows 1639, 1639, 1638, 1638, 1638)
  // cut one 2-row shard in two, at the odd boundary 1639.
  CHECK(plan->ops.size() == 3 * 4096 + 4096 + 1);
  CHECK(plan->dst_bytes == 4 * 8192 * 16 * 2);
}

}  // namespace
}  // namespace refit::plan

namespace refit::plan {
namespace {

TensorSlice PairSlice(const std::string& name, std::vector<int64_t> offsets,
                      std::vector<int64_t> sizes, std::vector<int64_t> strides, uint64_t at) {
  TensorSlice s;
  s.name = name;
  s.dtype = DType::kBF16;
  s.global_shape = {8, 16};
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  s.buffer_strides = std::move(strides);
  s.buffer_offset = at;
  return s;
}

TEST_CASE("paired destinations plan like BuildPlan, without matching names", "[plan]") {
  // Source: the whole [8, 16] tensor; destinations: two row bands, one strided. Paired under
  // another name, they get the ops BuildPlan gives them by name.
  const TensorSlice whole = PairSlice("w", {0, 0}, {8, 16}, {16, 1}, 0);
  TensorSlice renamed = whole;
  renamed.name = "renamed";
  const TensorSlice top = PairSlice("w", {0, 0}, {4, 16}, {32, 1}, 64);
  const TensorSlice bottom = PairSlice("w", {4, 0}, {4, 16}, {16, 1}, 0);
  PlanOptions options;
  options.multi_row_ops = true;
  auto by_name = BuildPlan({{&whole, 0, 0}}, {{&top, 0, 0}, {&bottom, 1, 0}}, options);
  REQUIRE(by_name.ok());
  auto paired = BuildPlan({}, {}, options,
                          {{{&renamed, 0, 0}, {&top, 0, 0}}, {{&renamed, 0, 0}, {&bottom, 1, 0}}});
  REQUIRE(paired.ok());
  REQUIRE(paired->ops == by_name->ops);
  REQUIRE(paired->src_bytes == by_name->src_bytes);
  // Named destinations first, then the pairs.
  auto mixed =
      BuildPlan({{&whole, 0, 0}}, {{&top, 0, 0}}, options, {{{&renamed, 0, 0}, {&bottom, 1, 0}}});
  REQUIRE(mixed.ok());
  REQUIRE(mixed->ops == by_name->ops);
}

TEST_CASE("a pair whose source does not hold its destination is refused", "[plan]") {
  const TensorSlice half = PairSlice("w", {0, 0}, {4, 16}, {16, 1}, 0);
  const TensorSlice whole = PairSlice("w", {0, 0}, {8, 16}, {16, 1}, 0);
  auto plan = BuildPlan({}, {}, PlanOptions(), {{{&half, 0, 0}, {&whole, 0, 0}}});
  REQUIRE(plan.status().code() == absl::StatusCode::kInvalidArgument);
  TensorSlice other = whole;
  other.dtype = DType::kINT32;
  plan = BuildPlan({}, {}, PlanOptions(), {{{&whole, 0, 0}, {&other, 0, 0}}});
  REQUIRE(plan.status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::plan
