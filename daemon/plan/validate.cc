// NormalizeAndValidateBuffer and SliceByteExtent: checks one buffer's slices, including an exact
// test that strided slices interleaved in one buffer share no byte.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/types.h"
#include "daemon/plan/plan.h"
#include "daemon/plan/scales.h"

namespace refit::plan {
namespace {

// Largest element count and element span we accept: leaves headroom for every product below.
constexpr uint64_t kMaxBytes = uint64_t{1} << 60;

std::string SliceLabel(const TensorSlice& slice, size_t index) {
  if (slice.name.empty()) return absl::StrCat("slice #", index, " (no name)");
  return absl::StrCat("tensor ", slice.name);
}

absl::Status Invalid(const TensorSlice& slice, size_t index, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(SliceLabel(slice, index), ": ", what));
}

std::string Join(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) absl::StrAppend(&out, i ? ", " : "", values[i]);
  return out + "]";
}

// Normalizes and checks one slice; `*end` is the byte past its last (SliceByteExtent's end) and
// `*contiguous` whether its elements are row-major contiguous (TensorSlice::IsContiguous), both
// worked out on the way (one pass over the slice).
absl::Status NormalizeOne(TensorSlice& slice, size_t index, uint64_t region_size, uint64_t* end_out,
                          bool* contiguous) {
  if (slice.name.empty()) return Invalid(slice, index, "empty name");
  const uint64_t elem = DTypeSize(slice.dtype);
  if (elem == 0) {
    return Invalid(slice, index,
                   absl::StrCat("unspecified or unknown dtype ", static_cast<int>(slice.dtype)));
  }
  const size_t rank = slice.global_shape.size();
  if (rank == 0) return Invalid(slice, index, "empty global_shape");
  for (int64_t dim : slice.global_shape) {
    if (dim <= 0) {
      return Invalid(slice, index,
                     absl::StrCat("non-positive global_shape ", Join(slice.global_shape)));
    }
  }
  if (slice.offsets.empty()) slice.offsets.assign(rank, 0);
  if (slice.offsets.size() != rank) {
    return Invalid(slice, index,
                   absl::StrCat("offsets ", Join(slice.offsets), " do not match rank ", rank,
                                " of global_shape"));
  }
  for (int64_t offset : slice.offsets) {
    if (offset < 0)
      return Invalid(slice, index, absl::StrCat("negative offset in ", Join(slice.offsets)));
  }
  if (slice.sizes.empty()) {
    // Empty sizes: the rest of the tensor from `offsets` (the whole tensor for zero offsets).
    slice.sizes.resize(rank);
    for (size_t d = 0; d < rank; ++d) slice.sizes[d] = slice.global_shape[d] - slice.offsets[d];
  }
  if (slice.sizes.size() != rank) {
    return Invalid(
        slice, index,
        absl::StrCat("sizes ", Join(slice.sizes), " do not match rank ", rank, " of global_shape"));
  }
  bool printable = true;  // BoxString adds offsets and sizes
  for (size_t d = 0; d < rank; ++d) {
    if (slice.sizes[d] <= 0)
      return Invalid(slice, index, absl::StrCat("non-positive size in ", Join(slice.sizes)));
    printable = printable && slice.offsets[d] <= INT64_MAX - slice.sizes[d];
  }
  uint64_t elements = 1;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t size = slice.sizes[d];
    if (slice.offsets[d] > slice.global_shape[d] - size) {
      return Invalid(slice, index,
                     absl::StrCat("box ",
                                  printable ? BoxString(slice.offsets, slice.sizes)
                                            : absl::StrCat("offsets ", Join(slice.offsets),
                                                           " sizes ", Join(slice.sizes)),
                                  " is outside global_shape ", Join(slice.global_shape)));
    }
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(size), &elements) ||
        elements > kMaxBytes) {
      return Invalid(slice, index, "too many elements");
    }
  }
  if (slice.buffer_strides.empty()) {
    slice.buffer_strides.assign(rank, 0);
    int64_t stride = 1;
    for (size_t d = rank; d-- > 0;) {
      slice.buffer_strides[d] = stride;
      stride *= slice.sizes[d];  // bounded by `elements` above
    }
  }
  if (slice.buffer_strides.size() != rank) {
    return Invalid(slice, index,
                   absl::StrCat("buffer_strides ", Join(slice.buffer_strides),
                                " do not match rank ", rank, " of global_shape"));
  }
  // Span of the slice in elements past its first one; every term checked for overflow.
  uint64_t span = 0;
  for (size_t d = 0; d < rank; ++d) {
    if (slice.sizes[d] == 1) continue;  // any stride is fine: it is never applied
    const int64_t stride = slice.buffer_strides[d];
    if (stride <= 0) {
      return Invalid(slice, index,
                     absl::StrCat("non-positive buffer_strides ", Join(slice.buffer_strides),
                                  " (only allowed where the size is 1)"));
    }
    uint64_t term = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(slice.sizes[d] - 1),
                               static_cast<uint64_t>(stride), &term) ||
        __builtin_add_overflow(span, term, &span) || span > kMaxBytes) {
      return Invalid(slice, index,
                     absl::StrCat("buffer_strides ", Join(slice.buffer_strides), " overflow"));
    }
  }
  uint64_t end = 0;
  if (__builtin_mul_overflow(span + 1, elem, &end) ||
      __builtin_add_overflow(end, slice.buffer_offset, &end) || end > region_size) {
    return Invalid(slice, index,
                   absl::StrCat("bytes from buffer_offset ", slice.buffer_offset, " with strides ",
                                Join(slice.buffer_strides), " run past the region of ", region_size,
                                " bytes"));
  }
  *end_out = end;
  int64_t expected = 1;  // the row-major stride of dimension d (IsContiguous)
  *contiguous = true;
  for (size_t d = rank; d-- > 0;) {
    if (slice.sizes[d] != 1 && slice.buffer_strides[d] != expected) *contiguous = false;
    expected *= slice.sizes[d];  // bounded by `elements` above
  }
  return absl::OkStatus();
}

// The bytes of a slice as nested blocks: dims_[0] is the outermost. A block at level l starting
// at byte b holds dims_[l].count sub-blocks at b + i * dims_[l].stride; a level-dims_.size()
// block is one run of run_ bytes. Nested: every stride is at least the extent of its sub-block,
// so sub-blocks are disjoint and in address order.
// Interleaved slices: clusters of at most this many are checked pair by pair; bigger ones by
// sorting their runs, when they have at most kMaxSweepRuns (24 bytes each) in all.
constexpr size_t kPairwiseCluster = 16;
constexpr uint64_t kMaxSweepRuns = uint64_t{1} << 22;
// What one buffer's pair-by-pair checks may walk in all (runs of the smaller layout of each pair
// compared). Past it, or past kMaxSweepRuns in a big cluster, the layout is refused rather than
// checked for minutes: a caller's request must not buy hours of a core.
constexpr uint64_t kMaxPairwiseRuns = uint64_t{1} << 26;

class ByteLayout {
 public:
  struct Dim {
    uint64_t count;
    uint64_t stride;  // bytes
  };

  // Returns false when the slice's own elements interleave or share bytes (not nested).
  bool Init(const TensorSlice& slice) {
    const uint64_t elem = DTypeSize(slice.dtype);
    base_ = slice.buffer_offset;
    std::vector<Dim> dims;  // innermost first after sorting
    for (size_t d = 0; d < slice.sizes.size(); ++d) {
      if (slice.sizes[d] == 1) continue;
      dims.push_back({static_cast<uint64_t>(slice.sizes[d]),
                      static_cast<uint64_t>(slice.buffer_strides[d]) * elem});
    }
    std::stable_sort(dims.begin(), dims.end(),
                     [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
    run_ = elem;
    std::vector<Dim> outer;  // innermost first
    uint64_t extent = run_;  // extent of the block built so far
    for (const Dim& dim : dims) {
      if (outer.empty() && dim.stride == run_) {
        run_ *= dim.count;
      } else if (!outer.empty() && dim.stride == outer.back().stride * outer.back().count) {
        if (dim.stride < extent) return false;
        outer.back().count *= dim.count;
      } else {
        if (dim.stride < extent) return false;
        outer.push_back(dim);
      }
      extent = (dim.count - 1) * dim.stride + extent;
      if (outer.empty()) extent = run_;
    }
    dims_.assign(outer.rbegin(), outer.rend());
    extents_.assign(dims_.size() + 1, run_);
    for (size_t l = dims_.size(); l-- > 0;) {
      extents_[l] = (dims_[l].count - 1) * dims_[l].stride + extents_[l + 1];
    }
    runs_ = 1;
    for (const Dim& dim : dims_) runs_ *= dim.count;
    return true;
  }

  uint64_t runs() const { return runs_; }

  // Calls f(begin, end) for every run, in address order.
  template <typename F>
  void ForEachRun(F&& f) const {
    ForEachRunAt(0, base_, f);
  }

  // True when some byte of the layout lies in [x, y).
  bool Hits(uint64_t x, uint64_t y) const { return HitsAt(0, base_, x, y); }

  // True when this layout and `other` share a byte. Walks this layout's runs that fall inside
  // `other`'s extent and asks `other` about each: O(runs * depth).
  bool Intersects(const ByteLayout& other) const {
    return IntersectsAt(0, base_, other, other.base_, other.base_ + other.extents_[0]);
  }

 private:
  // Sub-blocks i of the level-`level` block at `base` that touch [x, y), as [lo, hi].
  bool Range(size_t level, uint64_t base, uint64_t x, uint64_t y, uint64_t* lo,
             uint64_t* hi) const {
    const Dim& dim = dims_[level];
    const uint64_t sub = extents_[level + 1];
    if (y <= base) return false;
    *lo = x < base + sub ? 0 : (x - base - sub) / dim.stride + 1;
    *hi = std::min<uint64_t>((y - 1 - base) / dim.stride, dim.count - 1);
    return *lo <= *hi;
  }

  bool HitsAt(size_t level, uint64_t base, uint64_t x, uint64_t y) const {
    if (level == dims_.size()) return base < y && x < base + run_;
    uint64_t lo = 0;
    uint64_t hi = 0;
    if (!Range(level, base, x, y, &lo, &hi)) return false;
    for (uint64_t i = lo; i <= hi; ++i) {
      const uint64_t start = base + i * dims_[level].stride;
      if (start >= x) return true;  // start < y too: the sub-block's first byte is in [x, y)
      if (HitsAt(level + 1, start, x, y)) return true;
    }
    return false;
  }

  template <typename F>
  void ForEachRunAt(size_t level, uint64_t base, F& f) const {
    if (level == dims_.size()) {
      f(base, base + run_);
      return;
    }
    for (uint64_t i = 0; i < dims_[level].count; ++i) {
      ForEachRunAt(level + 1, base + i * dims_[level].stride, f);
    }
  }

  bool IntersectsAt(size_t level, uint64_t base, const ByteLayout& other, uint64_t x,
                    uint64_t y) const {
    if (level == dims_.size()) return base < y && x < base + run_ && other.Hits(base, base + run_);
    uint64_t lo = 0;
    uint64_t hi = 0;
    if (!Range(level, base, x, y, &lo, &hi)) return false;
    for (uint64_t i = lo; i <= hi; ++i) {
      if (IntersectsAt(level + 1, base + i * dims_[level].stride, other, x, y)) return true;
    }
    return false;
  }

  uint64_t base_ = 0;
  uint64_t run_ = 0;
  uint64_t runs_ = 0;
  std::vector<Dim> dims_;          // outermost first
  std::vector<uint64_t> extents_;  // extents_[l]: bytes spanned by one level-l block
};

}  // namespace

std::pair<uint64_t, uint64_t> SliceByteExtent(const TensorSlice& slice) {
  uint64_t span = 0;
  for (size_t d = 0; d < slice.sizes.size(); ++d) {
    if (slice.sizes[d] <= 1) continue;
    span +=
        static_cast<uint64_t>(slice.sizes[d] - 1) * static_cast<uint64_t>(slice.buffer_strides[d]);
  }
  return {slice.buffer_offset, slice.buffer_offset + (span + 1) * DTypeSize(slice.dtype)};
}

namespace {

struct Entry {
  uint64_t begin;
  uint64_t end;
  size_t index;
};

bool EntryBefore(const Entry& a, const Entry& b) {
  return a.begin != b.begin ? a.begin < b.begin : a.index < b.index;
}

// Sorts `entries` (in index order) by begin, then index: each entry joins the first of at most
// kLanes lanes whose last begin is not past its own (each lane then ascends), and the lanes are
// merged pairwise; with more lanes needed, std::sort.
void SortEntries(std::vector<Entry>& entries) {
  constexpr size_t kLanes = 4;
  std::vector<Entry> lanes[kLanes];
  size_t used = 0;
  for (const Entry& e : entries) {
    size_t lane = 0;
    while (lane < used && lanes[lane].back().begin > e.begin) ++lane;
    if (lane == kLanes) {
      std::sort(entries.begin(), entries.end(), EntryBefore);
      return;
    }
    if (lane == used) {
      ++used;
      lanes[lane].reserve(entries.size() / 2);
    }
    lanes[lane].push_back(e);
  }
  // Entries of one begin stay in index order: within a lane they are, and merge takes from the
  // lane of the smaller index first.
  while (used > 1) {
    std::vector<Entry> merged(lanes[used - 2].size() + lanes[used - 1].size());
    std::merge(lanes[used - 2].begin(), lanes[used - 2].end(), lanes[used - 1].begin(),
               lanes[used - 1].end(), merged.begin(), EntryBefore);
    lanes[used - 2].swap(merged);
    --used;
  }
  entries.swap(lanes[0]);
}

// The scaled slices' checks NormalizeAndValidateScaledBuffer makes on the way.
struct ScaledChecks {
  bool allowed = false;
  bool scaled = false;
  absl::Status first_error;
};

absl::Status NormalizeAndValidate(std::vector<TensorSlice>& slices, uint64_t region_size,
                                  ScaledChecks* checks);

}  // namespace

absl::Status NormalizeAndValidateBuffer(std::vector<TensorSlice>& slices, uint64_t region_size) {
  return NormalizeAndValidate(slices, region_size, nullptr);
}

absl::Status NormalizeAndValidateScaledBuffer(std::vector<TensorSlice>& slices,
                                              uint64_t region_size, bool scales_allowed,
                                              bool* scaled) {
  ScaledChecks checks;
  checks.allowed = scales_allowed;
  if (absl::Status valid = NormalizeAndValidate(slices, region_size, &checks); !valid.ok()) {
    return valid;
  }
  if (!checks.first_error.ok()) return checks.first_error;
  *scaled = checks.scaled;
  return absl::OkStatus();
}

namespace {

absl::Status NormalizeAndValidate(std::vector<TensorSlice>& slices, uint64_t region_size,
                                  ScaledChecks* checks) {
  // One pass normalizes, checks and measures each slice (its byte extent, contiguity), and,
  // with `checks`, checks a scaled slice while its fields are in the cache.
  std::vector<Entry> entries(slices.size());
  std::vector<char> contiguous(slices.size());
  bool sorted = true;
  for (size_t i = 0; i < slices.size(); ++i) {
    uint64_t end = 0;
    bool flat = false;
    if (absl::Status status = NormalizeOne(slices[i], i, region_size, &end, &flat); !status.ok()) {
      return status;
    }
    entries[i] = {slices[i].buffer_offset, end, i};
    contiguous[i] = flat;
    if (checks && IsScaled(slices[i])) {
      checks->scaled = true;
      if (checks->first_error.ok()) {
        checks->first_error =
            checks->allowed ? CheckScaledSlice(slices[i])
                            : absl::InvalidArgumentError(absl::StrCat(
                                  "tensor ", slices[i].name,
                                  ": scale_tensor and scale_block are for DESTINATION slices"));
      }
    }
    sorted = sorted && (i == 0 || entries[i - 1].begin <= entries[i].begin);
  }
  // In buffer order already (by begin, then index): the common case needs no sort. Nearly so
  // (an fp8 engine's weights in one part of its buffer and their scale tensors in another, the
  // slices of each in order, one after the other: a few ascending lanes interleaved): the lanes
  // merged, not sorted.
  if (!sorted) SortEntries(entries);
  // Layouts are built lazily: most slices are contiguous and never need one (nor its 72 bytes
  // made and freed: 100,000 slices per registration).
  std::vector<std::unique_ptr<ByteLayout>> layouts(slices.size());
  auto layout = [&](size_t index) -> const ByteLayout* {
    if (!layouts[index]) {
      auto made = std::make_unique<ByteLayout>();
      if (!made->Init(slices[index])) return nullptr;
      layouts[index] = std::move(made);
    }
    return layouts[index].get();
  };
  for (size_t i = 0; i < slices.size(); ++i) {
    const TensorSlice& slice = slices[i];
    if (!contiguous[i] && layout(i) == nullptr) {
      return Invalid(slice, i,
                     absl::StrCat("buffer_strides ", Join(slice.buffer_strides),
                                  " make the slice overlap itself or interleave its "
                                  "own elements"));
    }
  }
  auto shared = [&](size_t x, size_t y) {
    const size_t later = std::max(x, y);
    const size_t earlier = std::min(x, y);
    return Invalid(
        slices[later], later,
        absl::StrCat("shares bytes of its buffer with ", SliceLabel(slices[earlier], earlier), " ",
                     BoxString(slices[earlier].offsets, slices[earlier].sizes)));
  };
  auto too_complex = [&](size_t x, uint64_t runs) {
    return Invalid(
        slices[x], x,
        absl::StrCat("interleaves with the slices around it in more than ", runs,
                     " runs of bytes: too many to check for overlaps (lay the tensors out "
                     "contiguously, or register them in several buffers)"));
  };
  uint64_t pairwise_runs = 0;
  // Clusters: maximal runs of entries (in begin order) whose extents chain-overlap. Only slices
  // of one cluster can share a byte. A small cluster is checked pair by pair; a big one (many
  // interleaved slices, e.g. 8,000 strided columns of one matrix) by sorting all its runs and
  // comparing neighbours: O(R log R) for R runs rather than O(n^2) pairs.
  for (size_t first = 0; first < entries.size();) {
    size_t last = first + 1;
    uint64_t reach = entries[first].end;
    while (last < entries.size() && entries[last].begin < reach) {
      reach = std::max(reach, entries[last].end);
      ++last;
    }
    const size_t count = last - first;
    uint64_t runs = 0;
    if (count > kPairwiseCluster) {
      for (size_t e = first; e < last && runs <= kMaxSweepRuns; ++e) {
        const size_t index = entries[e].index;
        runs += contiguous[index] ? 1 : layout(index)->runs();
      }
    }
    if (count > kPairwiseCluster && runs > kMaxSweepRuns) {
      return too_complex(entries[first].index, kMaxSweepRuns);
    }
    if (count > kPairwiseCluster) {
      struct Run {
        uint64_t begin;
        uint64_t end;
        size_t index;
      };
      std::vector<Run> all;
      all.reserve(runs);
      for (size_t e = first; e < last; ++e) {
        const size_t index = entries[e].index;
        if (contiguous[index]) {
          all.push_back({entries[e].begin, entries[e].end, index});
        } else {
          layout(index)->ForEachRun([&](uint64_t begin, uint64_t end) {
            all.push_back({begin, end, index});
          });
        }
      }
      std::sort(all.begin(), all.end(), [](const Run& x, const Run& y) {
        return x.begin != y.begin ? x.begin < y.begin : x.index < y.index;
      });
      // A slice's own runs are disjoint (checked above), so a run starting before the furthest
      // end seen so far overlaps a run of another slice.
      size_t furthest = 0;
      for (size_t r = 1; r < all.size(); ++r) {
        if (all[r].begin < all[furthest].end) return shared(all[furthest].index, all[r].index);
        if (all[r].end > all[furthest].end) furthest = r;
      }
    } else {
      for (size_t a = first; a < last; ++a) {
        for (size_t b = a + 1; b < last && entries[b].begin < entries[a].end; ++b) {
          bool overlap = true;
          if (!contiguous[entries[a].index] || !contiguous[entries[b].index]) {
            const ByteLayout* la = layout(entries[a].index);
            const ByteLayout* lb = layout(entries[b].index);
            pairwise_runs += std::min(la->runs(), lb->runs());  // each at most 2^63: no wrap
            if (pairwise_runs > kMaxPairwiseRuns) {
              return too_complex(entries[b].index, kMaxPairwiseRuns);
            }
            overlap = la->runs() <= lb->runs() ? la->Intersects(*lb) : lb->Intersects(*la);
          }
          if (overlap) return shared(entries[a].index, entries[b].index);
        }
      }
    }
    first = last;
  }
  return absl::OkStatus();
}

}  // namespace

}  // namespace refit::plan
