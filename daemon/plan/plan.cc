// BuildPlan: covers every destination box from the sources of its tensor by box intersection and
// difference, emitting one op per run (or per block of runs) and coalescing adjacent ops.
// ExecuteOnHost: runs a plan with memcpy, strided copies and conversions.

#include "daemon/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/test_hooks.h"
#include "daemon/common/types.h"
#include "daemon/memory/stream_copy.h"
#include "daemon/plan/convert.h"

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

namespace {

// Ops moving at least this much use non-temporal stores: the destination isn't read again
// soon, and skipping the read-for-ownership of each line nearly doubles the copy rate for the
// medium-sized pieces (under glibc's own streaming threshold) that resharding produces.
constexpr uint64_t kStreamOpBytes = 1 << 20;

// Above this, glibc's memcpy streams by itself, faster than StreamCopy.
constexpr uint64_t kLibcStreamBytes = 16 << 20;

void Copy(uint8_t* to, const uint8_t* from, uint64_t n, bool stream) {
  if (stream && n < kLibcStreamBytes) {
    StreamCopy(to, from, n);
  } else {
    std::memcpy(to, from, n);
  }
}

bool IsMemcpyOp(const CopyOp& op) {
  return op.src_dtype == op.dst_dtype && op.src_stride == 1 && op.dst_stride == 1;
}

// Ops [first, last) fill side by side the same destination rows (a row-split tensor gathered
// from several sources): copying them row by row keeps each destination row hot in cache.
size_t RowGroupEnd(const std::vector<CopyOp>& ops, size_t first) {
  const CopyOp& a = ops[first];
  size_t last = first + 1;
  if (a.rows < 2 || !IsMemcpyOp(a)) return last;
  const uint64_t elem = DTypeSize(a.dst_dtype);
  while (last < ops.size()) {
    const CopyOp& prev = ops[last - 1];
    const CopyOp& b = ops[last];
    if (!IsMemcpyOp(b) || b.rows != a.rows || b.dst_location != a.dst_location ||
        b.dst_row_stride != a.dst_row_stride || b.dst_dtype != a.dst_dtype ||
        b.dst_offset != prev.dst_offset + prev.count * elem) {
      break;
    }
    ++last;
  }
  return last;
}

}  // namespace

namespace {

// A piece of a plan's execution: ops [first, last) (one op, or a row group), rows
// [row_begin, row_end) of it, and elements [elem_begin, elem_end) of each row.
struct Task {
  size_t first = 0, last = 0;
  uint64_t row_begin = 0, row_end = 0;
  uint64_t elem_begin = 0, elem_end = 0;
  bool stream = false;
};

// Work is cut into tasks of about this many bytes, so that threads share it evenly.
constexpr uint64_t kTaskBytes = 4 << 20;
// Below this a plan runs on the calling thread: starting threads would cost more.
constexpr uint64_t kParallelBytes = 32 << 20;

// A verified run checks each task right after it ran: small enough that the task's source and
// destination bytes are still in the core's own cache.
constexpr uint64_t kVerifiedTaskBytes = 256 << 10;

std::vector<Task> CutTasks(const std::vector<CopyOp>& ops, uint64_t* total_bytes,
                           uint64_t task_bytes = kTaskBytes) {
  std::vector<Task> tasks;
  *total_bytes = 0;
  for (size_t first = 0; first < ops.size();) {
    const size_t last = RowGroupEnd(ops, first);
    const CopyOp& op = ops[first];
    const uint64_t elem = DTypeSize(op.dst_dtype);
    uint64_t row_bytes = 0;
    for (size_t i = first; i < last; ++i) row_bytes += ops[i].count * elem;
    const uint64_t bytes = row_bytes * op.rows;
    *total_bytes += bytes;
    const bool stream = bytes >= kStreamOpBytes && (last - first > 1 || IsMemcpyOp(op));
    if (op.rows == 1 && last - first == 1) {
      // One long run: cut it by elements.
      const uint64_t step = std::max<uint64_t>(1, task_bytes / std::max<uint64_t>(1, elem));
      for (uint64_t e = 0; e < op.count; e += step) {
        tasks.push_back({first, last, 0, 1, e, std::min<uint64_t>(op.count, e + step), stream});
      }
    } else {
      const uint64_t step = std::max<uint64_t>(1, task_bytes / std::max<uint64_t>(1, row_bytes));
      for (uint64_t r = 0; r < op.rows; r += step) {
        tasks.push_back(
            {first, last, r, std::min<uint64_t>(op.rows, r + step), 0, op.count, stream});
      }
    }
    first = last;
  }
  return tasks;
}

void RunTask(const std::vector<CopyOp>& ops, const Task& t, const std::vector<const uint8_t*>& src,
             const std::vector<uint8_t*>& dst) {
  if (t.last - t.first > 1) {
    // A row group: destination rows filled side by side, each kept hot while it fills.
    const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      for (size_t i = t.first; i < t.last; ++i) {
        const CopyOp& op = ops[i];
        Copy(dst[op.dst_location] + op.dst_offset +
                 r * static_cast<uint64_t>(op.dst_row_stride) * elem,
             src[op.src_location] + op.src_offset +
                 r * static_cast<uint64_t>(op.src_row_stride) * elem,
             op.count * elem, t.stream);
      }
    }
    return;
  }
  const CopyOp& op = ops[t.first];
  const uint64_t src_elem = DTypeSize(op.src_dtype);
  const uint64_t dst_elem = DTypeSize(op.dst_dtype);
  const uint64_t n = t.elem_end - t.elem_begin;
  const uint8_t* from = src[op.src_location] + op.src_offset +
                        t.elem_begin * static_cast<uint64_t>(op.src_stride) * src_elem;
  uint8_t* to = dst[op.dst_location] + op.dst_offset +
                t.elem_begin * static_cast<uint64_t>(op.dst_stride) * dst_elem;
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    const uint8_t* row_from = from + r * static_cast<uint64_t>(op.src_row_stride) * src_elem;
    uint8_t* row_to = to + r * static_cast<uint64_t>(op.dst_row_stride) * dst_elem;
    if (IsMemcpyOp(op)) {
      Copy(row_to, row_from, n * src_elem, t.stream);
    } else {
      ConvertRun(row_from, op.src_dtype, op.src_stride, row_to, op.dst_dtype, op.dst_stride, n);
    }
  }
}

// True when the destination bytes of task `t` are what the plan writes there. `scratch`
// holds converted runs.
bool TaskLanded(const std::vector<CopyOp>& ops, const Task& t,
                const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                std::vector<uint8_t>* scratch) {
  if (t.last - t.first > 1) {
    const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      for (size_t i = t.first; i < t.last; ++i) {
        const CopyOp& op = ops[i];
        if (std::memcmp(dst[op.dst_location] + op.dst_offset +
                            r * static_cast<uint64_t>(op.dst_row_stride) * elem,
                        src[op.src_location] + op.src_offset +
                            r * static_cast<uint64_t>(op.src_row_stride) * elem,
                        op.count * elem) != 0) {
          return false;
        }
      }
    }
    return true;
  }
  const CopyOp& op = ops[t.first];
  const uint64_t src_elem = DTypeSize(op.src_dtype);
  const uint64_t dst_elem = DTypeSize(op.dst_dtype);
  const uint64_t n = t.elem_end - t.elem_begin;
  const uint8_t* from = src[op.src_location] + op.src_offset +
                        t.elem_begin * static_cast<uint64_t>(op.src_stride) * src_elem;
  const uint8_t* to = dst[op.dst_location] + op.dst_offset +
                      t.elem_begin * static_cast<uint64_t>(op.dst_stride) * dst_elem;
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    const uint8_t* row_from = from + r * static_cast<uint64_t>(op.src_row_stride) * src_elem;
    const uint8_t* row_to = to + r * static_cast<uint64_t>(op.dst_row_stride) * dst_elem;
    if (IsMemcpyOp(op)) {
      if (std::memcmp(row_to, row_from, n * src_elem) != 0) return false;
      continue;
    }
    // What the op writes, packed, then compared element by element at the op's stride.
    scratch->resize(n * dst_elem);
    ConvertRun(row_from, op.src_dtype, op.src_stride, scratch->data(), op.dst_dtype, 1, n);
    if (op.dst_stride == 1) {
      if (std::memcmp(row_to, scratch->data(), n * dst_elem) != 0) return false;
      continue;
    }
    for (uint64_t e = 0; e < n; ++e) {
      if (std::memcmp(row_to + e * static_cast<uint64_t>(op.dst_stride) * dst_elem,
                      scratch->data() + e * dst_elem, dst_elem) != 0) {
        return false;
      }
    }
  }
  return true;
}

// The fused verified copy: memcpy ops are copied with ordinary (write-back) stores and what
// landed is compared with the source once about kFusedBytes were copied, while those source and
// destination bytes are still in the core's own cache (reading them again costs little there).
// The compare loads the destination's cache lines, which another core or a device writing into
// that memory would have changed or invalidated: it checks the memory, not the copy's registers.
// One thread copying 256 MiB, CPU time against a streaming copy (docs/benchmarks.md, "Verified
// apply"): ordinary stores alone 0.88-0.91x (the write-allocate of each destination line), with
// the compare every 8 KiB 0.70-0.72x, every 16-32 KiB 0.78-0.88x, every 256 KiB 0.77-0.79x.
constexpr uint64_t kFusedBytes = 32 << 10;

// Copies runs and compares them in batches of about kFusedBytes: many short runs (a column
// shard's rows) are compared together, a long run in kFusedBytes pieces. One per thread.
class CheckedCopy {
 public:
  CheckedCopy() { runs_.reserve(64); }

  void Run(uint8_t* to, const uint8_t* from, uint64_t n) {
    while (n > 0) {
      const uint64_t k = std::min(n, kFusedBytes - pending_);
      std::memcpy(to, from, k);
      runs_.push_back({to, from, k});
      pending_ += k;
      if (pending_ >= kFusedBytes) Compare();
      to += k;
      from += k;
      n -= k;
    }
  }

  // Compares what is left; true when every byte copied since the last call landed.
  bool Landed() {
    Compare();
    const bool landed = landed_;
    landed_ = true;
    return landed;
  }

 private:
  struct CopiedRun {
    const uint8_t* to;
    const uint8_t* from;
    uint64_t n;
  };

  void Compare() {
    for (const CopiedRun& r : runs_) landed_ &= std::memcmp(r.to, r.from, r.n) == 0;
    runs_.clear();
    pending_ = 0;
  }

  std::vector<CopiedRun> runs_;
  uint64_t pending_ = 0;
  bool landed_ = true;
};

// Task `t` of memcpy ops, run and checked in one pass (CheckedCopy); false when a byte of it
// did not land.
// Where ExecuteSaveAndVerifyOnHost saves what each op overwrites. The ops of a row group
// (RowGroupEnd) are saved together, row by row, each row as it lies in the destination (the
// group's runs side by side); an op of its own row by row. So a task's rows are saved with
// one streaming copy per row, or one in all where the destination rows follow each other.
struct SaveArea {
  uint8_t* saved = nullptr;
  std::vector<uint64_t> at;         // per op: where its row 0 is saved
  std::vector<uint64_t> row_bytes;  // per op: its group's row, saved

  // `layout`: the offsets alone (RestorePlan), with no area to save into.
  SaveArea(const std::vector<CopyOp>& ops, uint8_t* to, bool layout = false) : saved(to) {
    if (saved == nullptr && !layout) return;
    at.resize(ops.size());
    row_bytes.resize(ops.size());
    uint64_t offset = 0;
    for (size_t first = 0; first < ops.size();) {
      const size_t last = RowGroupEnd(ops, first);
      uint64_t row = 0;
      for (size_t i = first; i < last; ++i) {
        at[i] = offset + row;
        row += ops[i].count * DTypeSize(ops[i].dst_dtype);
      }
      for (size_t i = first; i < last; ++i) row_bytes[i] = row;
      offset += ops[first].rows * row;
      first = last;
    }
  }
  // Where element `e` of row `r` of op `i` is saved.
  uint8_t* For(const std::vector<CopyOp>& ops, size_t i, uint64_t r, uint64_t e) const {
    return saved + at[i] + r * row_bytes[i] + e * DTypeSize(ops[i].dst_dtype);
  }
};

// The first and one-past-last element of each row that task `t` covers of op `i`.
std::pair<uint64_t, uint64_t> TaskElems(const std::vector<CopyOp>& ops, const Task& t, size_t i) {
  if (t.last - t.first > 1) return {0, ops[i].count};
  return {t.elem_begin, t.elem_end};
}

// Saves the destination bytes task `t` will overwrite (before it runs).
void SaveTask(const std::vector<CopyOp>& ops, const Task& t, const std::vector<uint8_t*>& dst,
              const SaveArea& save) {
  const CopyOp& op = ops[t.first];
  const uint64_t elem = DTypeSize(op.dst_dtype);
  const auto [begin, end] = TaskElems(ops, t, t.first);
  const uint64_t row = save.row_bytes[t.first];
  auto dst_at = [&](uint64_t r, uint64_t e) {
    return dst[op.dst_location] + op.dst_offset +
           (r * static_cast<uint64_t>(op.dst_row_stride) +
            e * static_cast<uint64_t>(op.dst_stride)) *
               elem;
  };
  if (op.dst_stride == 1 && (t.last - t.first > 1 || end - begin == op.count)) {
    // Whole rows, each contiguous in the destination (a row group's runs lie side by side).
    if (t.row_end - t.row_begin == 1 || static_cast<uint64_t>(op.dst_row_stride) * elem == row) {
      StreamCopy(save.For(ops, t.first, t.row_begin, 0), dst_at(t.row_begin, 0),
                 (t.row_end - t.row_begin) * row);
      return;
    }
    for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
      StreamCopy(save.For(ops, t.first, r, 0), dst_at(r, 0), row);
    }
    return;
  }
  // One op: part of each row, or strided elements.
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    uint8_t* to = save.For(ops, t.first, r, begin);
    if (op.dst_stride == 1) {
      StreamCopy(to, dst_at(r, begin), (end - begin) * elem);
      continue;
    }
    for (uint64_t e = begin; e < end; ++e) std::memcpy(to + (e - begin) * elem, dst_at(r, e), elem);
  }
}

bool RunAndCompareTask(const std::vector<CopyOp>& ops, const Task& t,
                       const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst,
                       CheckedCopy* copy) {
  const uint64_t elem = DTypeSize(ops[t.first].dst_dtype);
  for (uint64_t r = t.row_begin; r < t.row_end; ++r) {
    for (size_t i = t.first; i < t.last; ++i) {
      const CopyOp& op = ops[i];
      const auto [begin, end] = TaskElems(ops, t, i);
      copy->Run(dst[op.dst_location] + op.dst_offset +
                    (r * static_cast<uint64_t>(op.dst_row_stride) + begin) * elem,
                src[op.src_location] + op.src_offset +
                    (r * static_cast<uint64_t>(op.src_row_stride) + begin) * elem,
                (end - begin) * elem);
    }
  }
  return copy->Landed();
}

// Runs `work` (one call per thread; it takes tasks from `next` until none is left) on up to 8
// cores, or on the calling thread alone for plans under kParallelBytes.
void OnCores(size_t tasks, uint64_t total, const std::function<void()>& work) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads =
      total < kParallelBytes
          ? 1u
          : static_cast<unsigned>(std::min<uint64_t>({cores, 8u, std::max<uint64_t>(1, tasks)}));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

// Runs (when `run`) and checks every task on up to 8 cores; the ops of tasks that didn't land.
// With `saved`, each task's destination bytes are saved there first (ExecuteSaveAndVerifyOnHost).
std::vector<size_t> RunAndCheck(const Plan& plan, const std::vector<const uint8_t*>& src,
                                const std::vector<uint8_t*>& dst, bool run,
                                uint8_t* saved = nullptr, uint8_t* marks = nullptr) {
  const SaveArea save(plan.ops, run ? saved : nullptr);
  uint64_t total = 0;
  std::vector<Task> tasks = CutTasks(plan.ops, &total, kVerifiedTaskBytes);
  // Checked at once, the destination bytes must still be in cache: no streaming stores.
  for (Task& t : tasks) t.stream = false;
  // Test build only: a destination byte changes under the first task's copy (a concurrent
  // writer), in the first N verified applies.
  static std::atomic<long> flips{-1};
  if (run && flips.load() < 0) {
    const char* flip = TestSwitch("REFIT_FAULT_APPLY_FLIP");
    long expected = -1;
    flips.compare_exchange_strong(expected, flip ? std::atol(flip) : 0);
  }
  // Saves task i's destination bytes (with `saved`), then marks it saved (with `marks`): the
  // saved bytes reach memory before the mark, the mark before the task's first write.
  auto save_first = [&](size_t i) {
    if (save.saved == nullptr) return;
    SaveTask(plan.ops, tasks[i], dst, save);
    if (marks == nullptr) return;
    StoreFence();
    __atomic_store_n(&marks[i], uint8_t{1}, __ATOMIC_SEQ_CST);
  };
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::vector<size_t> bad;
  OnCores(tasks.size(), total, [&] {
    std::vector<uint8_t> scratch;
    CheckedCopy copy;
    for (size_t i = next++; i < tasks.size(); i = next++) {
      const bool flip = i == 0 && flips.load(std::memory_order_relaxed) > 0;
      if (run && !flip && IsMemcpyOp(plan.ops[tasks[i].first])) {
        // Copied and compared in one pass (a row group's ops are all memcpy ops).
        // With the undo save folded in, the task's destination bytes are saved first: that
        // read brings them into this core's cache, where the copy then overwrites them.
        save_first(i);
        const bool landed = RunAndCompareTask(plan.ops, tasks[i], src, dst, &copy);
        if (i == tasks.size() / 2) TestHookKillAt("apply");  // test build: a commit point
        if (!landed) {
          std::lock_guard<std::mutex> lock(mu);
          for (size_t op = tasks[i].first; op < tasks[i].last; ++op) bad.push_back(op);
        }
        continue;
      }
      if (run) {
        save_first(i);
        RunTask(plan.ops, tasks[i], src, dst);
        if (i == tasks.size() / 2) TestHookKillAt("apply");  // test build: a commit point
        if (i == 0 && flips.load(std::memory_order_relaxed) > 0 && flips-- > 0) {
          const CopyOp& op = plan.ops[tasks[i].first];
          dst[op.dst_location][op.dst_offset] ^= 0x5a;
        }
      }
      if (!TaskLanded(plan.ops, tasks[i], src, dst, &scratch)) {
        std::lock_guard<std::mutex> lock(mu);
        for (size_t op = tasks[i].first; op < tasks[i].last; ++op) bad.push_back(op);
      }
    }
    if (save.saved != nullptr) StoreFence();  // the saved bytes' streaming stores
  });
  std::sort(bad.begin(), bad.end());
  bad.erase(std::unique(bad.begin(), bad.end()), bad.end());
  return bad;
}

}  // namespace

std::vector<size_t> ExecuteAndVerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                           const std::vector<uint8_t*>& dst) {
  return RunAndCheck(plan, src, dst, /*run=*/true);
}

std::vector<size_t> ExecuteSaveAndVerifyOnHost(const Plan& plan,
                                               const std::vector<const uint8_t*>& src,
                                               const std::vector<uint8_t*>& dst, uint8_t* saved,
                                               uint8_t* marks) {
  return RunAndCheck(plan, src, dst, /*run=*/true, saved, marks);
}

uint64_t SavedBytes(const Plan& plan) {
  uint64_t bytes = 0;
  for (const CopyOp& op : plan.ops) bytes += op.rows * op.count * DTypeSize(op.dst_dtype);
  return bytes;
}

uint64_t SaveTasks(const Plan& plan) {
  uint64_t total = 0;
  return CutTasks(plan.ops, &total, kVerifiedTaskBytes).size();
}

Plan RestorePlan(const Plan& plan, const uint8_t* marks, std::vector<uint32_t>* pieces) {
  const SaveArea layout(plan.ops, nullptr, /*layout=*/true);
  Plan back;
  // Op i's rows [row_begin, row_end) and elements [begin, end) of each, from where they were saved.
  auto add = [&](size_t i, uint64_t row_begin, uint64_t row_end, uint64_t begin, uint64_t end) {
    const CopyOp& op = plan.ops[i];
    const uint64_t elem = DTypeSize(op.dst_dtype);
    CopyOp r = op;
    r.dst_offset = op.dst_offset + (row_begin * static_cast<uint64_t>(op.dst_row_stride) +
                                    begin * static_cast<uint64_t>(op.dst_stride)) *
                                       elem;
    r.count = end - begin;
    r.rows = row_end - row_begin;
    r.src_location = 0;
    r.src_offset = layout.at[i] + row_begin * layout.row_bytes[i] + begin * elem;
    r.src_stride = 1;
    r.src_dtype = op.dst_dtype;
    r.src_row_stride = static_cast<int64_t>(layout.row_bytes[i] / elem);
    back.ops.push_back(r);
    back.dst_bytes += r.rows * r.count * elem;
  };
  if (marks == nullptr && pieces == nullptr) {
    for (size_t i = 0; i < plan.ops.size(); ++i) add(i, 0, plan.ops[i].rows, 0, plan.ops[i].count);
  } else {
    uint64_t total = 0;
    const std::vector<Task> tasks = CutTasks(plan.ops, &total, kVerifiedTaskBytes);
    for (size_t k = 0; k < tasks.size(); ++k) {
      if (marks != nullptr && marks[k] == 0) continue;
      const Task& t = tasks[k];
      for (size_t i = t.first; i < t.last; ++i) {
        const auto [begin, end] = TaskElems(plan.ops, t, i);
        add(i, t.row_begin, t.row_end, begin, end);
        if (pieces != nullptr) pieces->push_back(static_cast<uint32_t>(k));
      }
    }
  }
  back.src_bytes = back.dst_bytes;
  return back;
}

std::vector<size_t> VerifyOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                                 const std::vector<uint8_t*>& dst) {
  return RunAndCheck(plan, src, dst, /*run=*/false);
}

void ExecuteOnHost(const Plan& plan, const std::vector<const uint8_t*>& src,
                   const std::vector<uint8_t*>& dst) {
  uint64_t total = 0;
  const std::vector<Task> tasks = CutTasks(plan.ops, &total);
  std::atomic<size_t> next{0};
  OnCores(tasks.size(), total, [&] {
    for (size_t i = next++; i < tasks.size(); i = next++) RunTask(plan.ops, tasks[i], src, dst);
    StoreFence();
  });
}

}  // namespace refit::plan
