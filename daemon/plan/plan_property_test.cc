// Property test: random models, random layouts on both sides (grids of uneven cuts, replicas,
// fusions, strided and transposed placements, dtype conversions), executed on host memory and
// checked element by element against the layouts.

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/common/types.h"
#include "daemon/plan/plan.h"
#include "daemon/plan/plan_testing.h"

namespace refit::plan {
namespace {

using testing::Buffer;
using testing::TensorSpec;

int Uniform(std::mt19937_64& rng, int lo, int hi) {  // inclusive
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

bool Chance(std::mt19937_64& rng, double p) {
  return std::uniform_real_distribution<double>(0, 1)(rng) < p;
}

// Random cut points of [0, n): returns boundaries 0 = b0 < b1 < ... < bk = n.
std::vector<int64_t> Cuts(std::mt19937_64& rng, int64_t n, int max_parts) {
  const int parts = Uniform(rng, 1, static_cast<int>(std::min<int64_t>(n, max_parts)));
  std::vector<int64_t> inner;
  for (int64_t i = 1; i < n; ++i) inner.push_back(i);
  std::shuffle(inner.begin(), inner.end(), rng);
  inner.resize(parts - 1);
  std::sort(inner.begin(), inner.end());
  std::vector<int64_t> bounds{0};
  bounds.insert(bounds.end(), inner.begin(), inner.end());
  bounds.push_back(n);
  return bounds;
}

// All cells of a random grid over `spec`.
std::vector<TensorSlice> Grid(std::mt19937_64& rng, const TensorSpec& spec, DType dtype) {
  std::vector<std::vector<int64_t>> cuts;
  for (int64_t dim : spec.shape) cuts.push_back(Cuts(rng, dim, 4));
  std::vector<TensorSlice> cells;
  std::vector<size_t> idx(spec.shape.size(), 0);
  while (true) {
    std::vector<int64_t> offsets;
    std::vector<int64_t> sizes;
    for (size_t d = 0; d < idx.size(); ++d) {
      offsets.push_back(cuts[d][idx[d]]);
      sizes.push_back(cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
    }
    cells.push_back(testing::Box(spec, offsets, sizes, dtype));
    size_t d = idx.size();
    while (d > 0) {
      --d;
      if (++idx[d] + 1 < cuts[d].size()) break;
      idx[d] = 0;
      if (d == 0) return cells;
    }
  }
}

// Lays out each location's slices: contiguous (with odd gaps), strided/transposed, or
// column-fused with the next slice.
void Pack(std::mt19937_64& rng, const std::vector<std::vector<TensorSlice>>& per_location,
          std::vector<Buffer>& buffers) {
  for (size_t loc = 0; loc < per_location.size(); ++loc) {
    const std::vector<TensorSlice>& list = per_location[loc];
    Buffer& buffer = buffers[loc];
    for (size_t i = 0; i < list.size(); ++i) {
      const TensorSlice& s = list[i];
      if (i + 1 < list.size() && s.sizes.size() == 2 && list[i + 1].sizes.size() == 2 &&
          s.sizes[0] == list[i + 1].sizes[0] && s.dtype == list[i + 1].dtype && Chance(rng, 0.3)) {
        testing::AppendColumnFused(buffer, {s, list[i + 1]});
        ++i;
      } else if (Chance(rng, 0.25)) {
        std::vector<int> order(s.sizes.size());
        for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int>(d);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<int64_t> pad(order.size());
        for (int64_t& p : pad) p = Uniform(rng, 0, 2);
        testing::AppendStrided(buffer, s, order, pad);
      } else {
        testing::Append(buffer, s, Chance(rng, 0.2) ? Uniform(rng, 1, 5) : 0);
      }
    }
  }
}

struct Case {
  std::vector<TensorSpec> model;
  std::vector<Buffer> sources;
  std::vector<Buffer> destinations;
};

Case RandomCase(std::mt19937_64& rng) {
  Case c;
  const int tensors = Uniform(rng, 1, 5);
  for (int t = 0; t < tensors; ++t) {
    TensorSpec spec;
    spec.name = "t" + std::to_string(t);
    const DType dtypes[] = {DType::kBF16, DType::kBF16, DType::kFP16, DType::kFP32, DType::kINT32};
    spec.dtype = dtypes[Uniform(rng, 0, 4)];
    const int rank = Uniform(rng, 1, 3);
    for (int d = 0; d < rank; ++d) spec.shape.push_back(Uniform(rng, 1, rank == 1 ? 40 : 12));
    c.model.push_back(spec);
  }
  const int source_locations = Uniform(rng, 1, 6);
  const int nodes = Uniform(rng, 1, 3);
  const int dest_locations = Uniform(rng, 1, 4);
  std::vector<std::vector<TensorSlice>> src_lists(source_locations);
  std::vector<std::vector<TensorSlice>> dst_lists(dest_locations);
  for (const TensorSpec& spec : c.model) {
    for (TensorSlice& cell : Grid(rng, spec, spec.dtype)) {
      std::vector<int> locs(source_locations);
      for (int i = 0; i < source_locations; ++i) locs[i] = i;
      std::shuffle(locs.begin(), locs.end(), rng);
      const int replicas = Chance(rng, 0.3) ? Uniform(rng, 1, source_locations) : 1;
      for (int r = 0; r < replicas; ++r) src_lists[locs[r]].push_back(cell);
    }
    DType dest_dtype = spec.dtype;
    if (spec.dtype == DType::kBF16) {
      const DType options[] = {DType::kBF16, DType::kFP16, DType::kFP32};
      dest_dtype = options[Uniform(rng, 0, 2)];
    } else if (spec.dtype == DType::kFP16 && Chance(rng, 0.5)) {
      dest_dtype = DType::kFP32;
    }
    for (TensorSlice& cell : Grid(rng, spec, dest_dtype)) {
      const int copies = Chance(rng, 0.1) ? 2 : 1;  // a destination replica (data parallel)
      for (int r = 0; r < copies; ++r)
        dst_lists[Uniform(rng, 0, dest_locations - 1)].push_back(cell);
    }
  }
  for (auto& list : src_lists) std::shuffle(list.begin(), list.end(), rng);
  for (auto& list : dst_lists) std::shuffle(list.begin(), list.end(), rng);
  c.sources.resize(source_locations);
  for (int i = 0; i < source_locations; ++i) c.sources[i].node = i % nodes;
  c.destinations.resize(dest_locations);
  Pack(rng, src_lists, c.sources);
  Pack(rng, dst_lists, c.destinations);
  return c;
}

// Independently: does every destination element have a source element?
bool FullyCovered(const Case& c) {
  for (const TensorSpec& spec : c.model) {
    uint64_t total = 1;
    for (int64_t d : spec.shape) total *= d;
    std::vector<char> covered(total, 0);
    auto mark = [&](const TensorSlice& s, bool check) {
      const size_t rank = s.sizes.size();
      std::vector<int64_t> idx(rank, 0);
      for (uint64_t n = 0; n < s.NumElements(); ++n) {
        uint64_t g = 0;
        for (size_t d = 0; d < rank; ++d) g = g * s.global_shape[d] + s.offsets[d] + idx[d];
        if (check && !covered[g]) return false;
        covered[g] = 1;
        for (size_t d = rank; d-- > 0;) {
          if (++idx[d] < s.sizes[d]) break;
          idx[d] = 0;
        }
      }
      return true;
    };
    for (const Buffer& b : c.sources) {
      for (const TensorSlice& s : b.slices) {
        if (s.name == spec.name) mark(s, false);
      }
    }
    for (const Buffer& b : c.destinations) {
      for (const TensorSlice& s : b.slices) {
        if (s.name == spec.name && !mark(s, true)) return false;
      }
    }
  }
  return true;
}

TEST_CASE("random layouts: every destination element copied once with its value",
          "[plan][property]") {
  std::mt19937_64 rng(20240611);
  int checked = 0;
  int uncovered = 0;
  for (int iteration = 0; iteration < 400; ++iteration) {
    Case c = RandomCase(rng);
    if (Chance(rng, 0.2)) {  // drop a source slice: may leave a hole
      std::vector<size_t> nonempty;
      for (size_t i = 0; i < c.sources.size(); ++i) {
        if (!c.sources[i].slices.empty()) nonempty.push_back(i);
      }
      Buffer& b = c.sources[nonempty[Uniform(rng, 0, static_cast<int>(nonempty.size()) - 1)]];
      b.slices.erase(b.slices.begin() + Uniform(rng, 0, static_cast<int>(b.slices.size()) - 1));
    }
    INFO("iteration " << iteration);
    testing::Finish(c.sources);
    testing::Finish(c.destinations);
    testing::FillSources(c.sources);
    const std::vector<PlacedSlice> src = testing::Place(c.sources);
    const std::vector<PlacedSlice> dst = testing::Place(c.destinations);
    const bool covered = FullyCovered(c);
    for (bool multi_row : {false, true}) {
      PlanOptions options;
      options.multi_row_ops = multi_row;
      if (Chance(rng, 0.3)) options.local_node = Uniform(rng, 0, 2);
      absl::StatusOr<Plan> plan = BuildPlan(src, dst, options);
      if (!covered) {
        REQUIRE(plan.status().code() == absl::StatusCode::kFailedPrecondition);
        continue;
      }
      REQUIRE(plan.ok());
      for (const CopyOp& op : plan->ops) {
        REQUIRE(op.count > 0);
        REQUIRE(op.rows > 0);
        REQUIRE((multi_row || op.rows == 1));
      }
      REQUIRE(testing::ExecuteAndCheck(*plan, c.sources, c.destinations) == "");
      absl::StatusOr<Plan> again = BuildPlan(src, dst, options);
      REQUIRE(again.ok());
      REQUIRE(again->ops == plan->ops);
    }
    if (covered) {
      ++checked;
    } else {
      ++uncovered;
    }
  }
  // The generator must exercise both outcomes.
  CHECK(checked > 250);
  CHECK(uncovered > 10);
}

}  // namespace
}  // namespace refit::plan
