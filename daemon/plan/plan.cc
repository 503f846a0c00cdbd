// BuildPlan: covers every destination box from the sources of its tensor by box intersection and
// difference, emitting one op per run (or per block of runs) and coalescing adjacent ops.
// Running a plan (ExecuteOnHost and the verified variants) is in plan_execute.cc.

#include "daemon/plan/plan.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/types.h"
#include "daemon/plan/dtype_convert.h"

namespace refit::plan {

bool CopyOp::operator==(const CopyOp& other) const {
  return src_location == other.src_location && src_offset == other.src_offset &&
         dst_location == other.dst_location && dst_offset == other.dst_offset &&
         count == other.count && src_stride == other.src_stride && dst_stride == other.dst_stride &&
         src_dtype == other.src_dtype && dst_dtype == other.dst_dtype && rows == other.rows &&
         src_row_stride == other.src_row_stride && dst_row_stride == other.dst_row_stride;
}

namespace {

// A box in global coordinates: [lo[d], hi[d]) per dimension.
struct Box {
  std::vector<int64_t> lo;
  std::vector<int64_t> hi;
};

Box SliceBox(const TensorSlice& slice) {
  Box box{slice.offsets, slice.offsets};
  for (size_t d = 0; d < box.hi.size(); ++d) box.hi[d] += slice.sizes[d];
  return box;
}

// Intersection of `a` and `b` into `out`; false when empty.
bool Intersect(const Box& a, const Box& b, Box* out) {
  const size_t rank = a.lo.size();
  out->lo.resize(rank);
  out->hi.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    out->lo[d] = std::max(a.lo[d], b.lo[d]);
    out->hi[d] = std::min(a.hi[d], b.hi[d]);
    if (out->lo[d] >= out->hi[d]) return false;
  }
  return true;
}

// Appends `r` minus `cut` (cut inside r) as at most 2 * rank disjoint boxes.
void Subtract(const Box& r, const Box& cut, std::vector<Box>* out) {
  Box rest = r;  // shrinks to `cut` one dimension at a time
  for (size_t d = 0; d < r.lo.size(); ++d) {
    if (rest.lo[d] < cut.lo[d]) {
      Box below = rest;
      below.hi[d] = cut.lo[d];
      out->push_back(std::move(below));
    }
    if (cut.hi[d] < rest.hi[d]) {
      Box above = rest;
      above.lo[d] = cut.hi[d];
      out->push_back(std::move(above));
    }
    rest.lo[d] = cut.lo[d];
    rest.hi[d] = cut.hi[d];
  }
}

absl::Status CheckPlaced(const PlacedSlice& placed, const char* side) {
  const TensorSlice* slice = placed.slice;
  if (slice == nullptr) return absl::InvalidArgumentError(absl::StrCat(side, " slice is null"));
  const size_t rank = slice->global_shape.size();
  if (DTypeSize(slice->dtype) == 0 || rank == 0 || slice->offsets.size() != rank ||
      slice->sizes.size() != rank || slice->buffer_strides.size() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(side, " slice of tensor ", slice->name, " is not normalized"));
  }
  return absl::OkStatus();
}

// One dimension of the iteration space of a copy: `count` steps of the given element strides.
struct IterDim {
  uint64_t count;
  int64_t src_stride;
  int64_t dst_stride;
};

class PlanBuilder {
 public:
  explicit PlanBuilder(const PlanOptions& options) : options_(options) {}

  absl::Status Build(const std::vector<PlacedSlice>& sources,
                     const std::vector<PlacedSlice>& destinations) {
    std::unordered_map<std::string_view, Group> by_name;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (absl::Status status = CheckPlaced(sources[i], "source"); !status.ok()) return status;
      const TensorSlice& slice = *sources[i].slice;
      std::vector<uint32_t>& group = by_name[slice.name].members;
      if (!group.empty()) {
        const TensorSlice& first = *sources[group.front()].slice;
        if (first.dtype != slice.dtype || first.global_shape != slice.global_shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor ", slice.name, ": source slices disagree on dtype or global shape (",
              DTypeName(first.dtype), " ",
              BoxString(std::vector<int64_t>(first.global_shape.size()), first.global_shape),
              " vs ", DTypeName(slice.dtype), " ",
              BoxString(std::vector<int64_t>(slice.global_shape.size()), slice.global_shape), ")"));
        }
      }
      group.push_back(static_cast<uint32_t>(i));
    }
    for (auto& [name, group] : by_name) Prepare(sources, &group);
    std::unordered_map<std::string_view, uint32_t> visits;  // destination slices seen per tensor
    std::vector<uint32_t> order;
    std::vector<Box> remaining;
    std::vector<Box> next;
    Box piece;
    for (const PlacedSlice& dest : destinations) {
      if (absl::Status status = CheckPlaced(dest, "destination"); !status.ok()) return status;
      const TensorSlice& d = *dest.slice;
      const auto it = by_name.find(d.name);
      if (it == by_name.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor ", d.name, ": no source holds this tensor"));
      }
      const TensorSlice& first = *sources[it->second.members.front()].slice;
      if (first.global_shape != d.global_shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", d.name, ": destination global shape ",
            BoxString(std::vector<int64_t>(d.global_shape.size()), d.global_shape),
            " differs from the source's ",
            BoxString(std::vector<int64_t>(first.global_shape.size()), first.global_shape)));
      }
      if (first.dtype != d.dtype) {
        if (absl::Status status = CheckConvertible(first.dtype, d.dtype); !status.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", d.name, ": ", status.message()));
        }
      }
      OrderSources(sources, it->second, visits[d.name]++, &order);
      remaining.assign(1, SliceBox(d));
      for (uint32_t s : order) {
        const PlacedSlice& src = sources[s];
        const Box src_box = SliceBox(*src.slice);
        next.clear();
        for (const Box& r : remaining) {
          if (!Intersect(r, src_box, &piece)) {
            next.push_back(r);
            continue;
          }
          Emit(src, dest, piece);
          Subtract(r, piece, &next);
        }
        remaining.swap(next);
        if (remaining.empty()) break;
      }
      if (!remaining.empty()) {
        const Box& box = remaining.front();
        std::vector<int64_t> sizes(box.lo.size());
        for (size_t k = 0; k < sizes.size(); ++k) sizes[k] = box.hi[k] - box.lo[k];
        return absl::FailedPreconditionError(
            absl::StrCat("tensor ", d.name, ": destination region ", BoxString(box.lo, sizes),
                         " is not covered by any source"));
      }
    }
    return absl::OkStatus();
  }

  // Appends the ops of `pair` (BuildPlan's overload with pairs).
  absl::Status AddPair(const SlicePair& pair) {
    if (absl::Status status = CheckPlaced(pair.source, "source"); !status.ok()) return status;
    if (absl::Status status = CheckPlaced(pair.destination, "destination"); !status.ok()) {
      return status;
    }
    const TensorSlice& s = *pair.source.slice;
    const TensorSlice& d = *pair.destination.slice;
    if (s.offsets.size() != d.offsets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", d.name, ": paired with a source of another rank"));
    }
    const Box box = SliceBox(d);
    Box inside;
    if (!Intersect(box, SliceBox(s), &inside) || inside.lo != box.lo || inside.hi != box.hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", d.name, ": its paired source does not hold all of it"));
    }
    if (s.dtype != d.dtype) {
      if (absl::Status status = CheckConvertible(s.dtype, d.dtype); !status.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", d.name, ": ", status.message()));
      }
    }
    Emit(pair.source, pair.destination, box);
    return absl::OkStatus();
  }

  Plan Take() { return std::move(plan_); }

 private:
  // The sources of one tensor.
  struct Group {
    std::vector<uint32_t> members;
    // No two members share an element: there is no choice to make, and members are kept in box
    // order so that the remaining region of a destination stays a few boxes (FSDP over
    // thousands of ranks would otherwise fragment it into thousands).
    bool disjoint = false;
  };

  static void Prepare(const std::vector<PlacedSlice>& sources, Group* group) {
    std::vector<std::pair<Box, uint32_t>> boxes;
    boxes.reserve(group->members.size());
    for (uint32_t m : group->members) boxes.push_back({SliceBox(*sources[m].slice), m});
    std::sort(boxes.begin(), boxes.end(), [](const auto& a, const auto& b) {
      return a.first.lo != b.first.lo ? a.first.lo < b.first.lo : a.second < b.second;
    });
    // Sweep along dimension 0; only boxes whose dim-0 ranges meet can share an element.
    group->disjoint = true;
    std::vector<size_t> active;
    Box unused;
    for (size_t i = 0; i < boxes.size() && group->disjoint; ++i) {
      const Box& box = boxes[i].first;
      size_t kept = 0;
      for (size_t a : active) {
        if (boxes[a].first.hi[0] <= box.lo[0]) continue;
        if (Intersect(boxes[a].first, box, &unused)) group->disjoint = false;
        active[kept++] = a;
      }
      active.resize(kept);
      active.push_back(i);
    }
    if (group->disjoint) {
      for (size_t i = 0; i < boxes.size(); ++i) group->members[i] = boxes[i].second;
    }
  }

  // The order to try a tensor's sources in for one destination slice: for replicated sources,
  // this node's first (when set), then the node that has given the fewest bytes so far, ties
  // broken by a rotation that advances with each destination slice of the tensor. Deterministic.
  void OrderSources(const std::vector<PlacedSlice>& sources, const Group& group_info,
                    uint32_t visit, std::vector<uint32_t>* order) {
    const std::vector<uint32_t>& group = group_info.members;
    order->assign(group.begin(), group.end());
    if (group.size() == 1 || group_info.disjoint) return;
    const size_t n = group.size();
    const size_t shift = visit % n;
    std::rotate(order->begin(), order->begin() + shift, order->end());
    std::vector<std::pair<uint64_t, uint32_t>> keyed;  // (key, rotated position)
    keyed.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t node = sources[(*order)[i]].node;
      const bool local = options_.local_node.has_value() && *options_.local_node == node;
      const auto load = node_bytes_.find(node);
      const uint64_t bytes = load == node_bytes_.end() ? 0 : load->second;
      keyed.push_back({local ? 0 : bytes + 1, static_cast<uint32_t>(i)});
    }
    std::stable_sort(keyed.begin(), keyed.end());
    std::vector<uint32_t> sorted(n);
    for (size_t i = 0; i < n; ++i) sorted[i] = (*order)[keyed[i].second];
    order->swap(sorted);
  }

  // Emits the ops copying global box `box` from `src` into `dest`.
  void Emit(const PlacedSlice& src, const PlacedSlice& dest, const Box& box) {
    const TensorSlice& s = *src.slice;
    const TensorSlice& d = *dest.slice;
    const uint64_t src_elem = DTypeSize(s.dtype);
    const uint64_t dst_elem = DTypeSize(d.dtype);
    uint64_t src_base = s.buffer_offset;
    uint64_t dst_base = d.buffer_offset;
    dims_.clear();
    for (size_t k = 0; k < box.lo.size(); ++k) {
      src_base +=
          static_cast<uint64_t>((box.lo[k] - s.offsets[k]) * s.buffer_strides[k]) * src_elem;
      dst_base +=
          static_cast<uint64_t>((box.lo[k] - d.offsets[k]) * d.buffer_strides[k]) * dst_elem;
      const uint64_t count = static_cast<uint64_t>(box.hi[k] - box.lo[k]);
      if (count == 1) continue;  // contributes only to the base
      const IterDim dim{count, s.buffer_strides[k], d.buffer_strides[k]};
      // Fold into the previous (outer) dimension when the pair walks like one dimension.
      if (!dims_.empty()) {
        IterDim& outer = dims_.back();
        if (outer.src_stride == dim.src_stride * static_cast<int64_t>(dim.count) &&
            outer.dst_stride == dim.dst_stride * static_cast<int64_t>(dim.count)) {
          outer = {outer.count * dim.count, dim.src_stride, dim.dst_stride};
          continue;
        }
      }
      dims_.push_back(dim);
    }
    CopyOp op;
    op.src_location = src.location;
    op.dst_location = dest.location;
    op.src_dtype = s.dtype;
    op.dst_dtype = d.dtype;
    if (dims_.empty()) dims_.push_back({1, 1, 1});
    const IterDim run = dims_.back();
    dims_.pop_back();
    op.count = run.count;
    op.src_stride = run.count == 1 ? 1 : run.src_stride;
    op.dst_stride = run.count == 1 ? 1 : run.dst_stride;
    if (options_.multi_row_ops && !dims_.empty()) {
      const IterDim rows = dims_.back();
      dims_.pop_back();
      op.rows = rows.count;
      op.src_row_stride = rows.src_stride;
      op.dst_row_stride = rows.dst_stride;
    }
    const uint64_t per_op = op.rows * op.count;
    node_bytes_[src.node] += per_op * src_elem * [&] {
      uint64_t n = 1;
      for (const IterDim& dim : dims_) n *= dim.count;
      return n;
    }();
    // Odometer over the outer dimensions.
    index_.assign(dims_.size(), 0);
    uint64_t src_off = src_base;
    uint64_t dst_off = dst_base;
    while (true) {
      op.src_offset = src_off;
      op.dst_offset = dst_off;
      Push(op, src_elem, dst_elem);
      size_t k = dims_.size();
      while (k > 0) {
        --k;
        const IterDim& dim = dims_[k];
        if (++index_[k] < dim.count) {
          src_off += static_cast<uint64_t>(dim.src_stride) * src_elem;
          dst_off += static_cast<uint64_t>(dim.dst_stride) * dst_elem;
          break;
        }
        src_off -= (dim.count - 1) * static_cast<uint64_t>(dim.src_stride) * src_elem;
        dst_off -= (dim.count - 1) * static_cast<uint64_t>(dim.dst_stride) * dst_elem;
        index_[k] = 0;
        if (k == 0) return;
      }
      if (dims_.empty()) return;
    }
  }

  // Appends `op`, merging it into the previous op when it continues it exactly.
  void Push(const CopyOp& op, uint64_t src_elem, uint64_t dst_elem) {
    plan_.src_bytes += op.rows * op.count * src_elem;
    plan_.dst_bytes += op.rows * op.count * dst_elem;
    if (!plan_.ops.empty()) {
      CopyOp& last = plan_.ops.back();
      if (last.src_location == op.src_location && last.dst_location == op.dst_location &&
          last.src_dtype == op.src_dtype && last.dst_dtype == op.dst_dtype) {
        if (last.rows == 1 && op.rows == 1 && last.src_stride == op.src_stride &&
            last.dst_stride == op.dst_stride &&
            last.src_offset + last.count * last.src_stride * src_elem == op.src_offset &&
            last.dst_offset + last.count * last.dst_stride * dst_elem == op.dst_offset) {
          last.count += op.count;
          return;
        }
        if (last.rows > 1 && op.rows > 1 && last.count == op.count &&
            last.src_stride == op.src_stride && last.dst_stride == op.dst_stride &&
            last.src_row_stride == op.src_row_stride && last.dst_row_stride == op.dst_row_stride &&
            last.src_offset + last.rows * last.src_row_stride * src_elem == op.src_offset &&
            last.dst_offset + last.rows * last.dst_row_stride * dst_elem == op.dst_offset) {
          last.rows += op.rows;
          return;
        }
      }
    }
    plan_.ops.push_back(op);
  }

  const PlanOptions& options_;
  Plan plan_;
  std::unordered_map<uint32_t, uint64_t> node_bytes_;  // source bytes taken from each node
  std::vector<IterDim> dims_;
  std::vector<uint64_t> index_;
};

}  // namespace

absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations) {
  return BuildPlan(sources, destinations, PlanOptions());
}

absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations,
                               const PlanOptions& options) {
  PlanBuilder builder(options);
  if (absl::Status status = builder.Build(sources, destinations); !status.ok()) return status;
  return builder.Take();
}

absl::StatusOr<Plan> BuildPlan(const std::vector<PlacedSlice>& sources,
                               const std::vector<PlacedSlice>& destinations,
                               const PlanOptions& options, const std::vector<SlicePair>& pairs) {
  PlanBuilder builder(options);
  if (!destinations.empty()) {
    if (absl::Status status = builder.Build(sources, destinations); !status.ok()) return status;
  }
  for (const SlicePair& pair : pairs) {
    if (absl::Status status = builder.AddPair(pair); !status.ok()) return status;
  }
  return builder.Take();
}

}  // namespace refit::plan
