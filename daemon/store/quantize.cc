// QuantCache: a version's fp8 destinations quantized into derived slots, band by band.
#include "daemon/store/quantize.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/quantize.h"
#include "daemon/plan/scales.h"

namespace refit {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// One job's part of the slot a Slots call acquires for all the jobs it quantizes (one slot, not
// one per job: a model of 100,000 tensors would otherwise take 100,000 slots a version).
class SubRegion : public Region {
 public:
  SubRegion(std::shared_ptr<Region> parent, uint64_t offset, uint64_t size)
      : Region(parent->kind(), parent->device(), parent->data() + offset, size),
        parent_(std::move(parent)) {}
  std::string Describe() const override { return absl::StrCat("part of ", parent_->Describe()); }

 private:
  std::shared_ptr<Region> parent_;
};

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * sizes[d];
  return strides;
}

uint64_t Product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  uint64_t p = 1;
  for (size_t d = begin; d < end; ++d) p *= static_cast<uint64_t>(dims[d]);
  return p;
}

// How a job's box is cut for the kernel. The box is viewed as rows of its last dimension; a
// band is one block of dimension 0 (the whole box for a 1-D tensor), so every block of the
// band lies inside it and its rows map onto the band's scale rows the same way every time.
struct Geometry {
  size_t rank = 0;
  uint64_t bands = 1;
  int64_t band_step = 0;            // dimension-0 elements per band (rank >= 2)
  uint64_t inner_rows = 1;          // rows per dimension-0 index (rank >= 2)
  std::vector<uint32_t> map_inner;  // scale row of each of those
  uint64_t scale_rows = 1;          // per band
  uint64_t scale_cols = 1;
  uint64_t cols = 0;
  uint64_t block_cols = 0;
};

Geometry GeometryOf(const QuantJob& job) {
  Geometry g;
  const std::vector<int64_t>& sizes = job.fp8.sizes;
  g.rank = sizes.size();
  g.cols = static_cast<uint64_t>(sizes.back());
  g.block_cols = static_cast<uint64_t>(job.block.back());
  g.scale_cols = CeilDiv(g.cols, g.block_cols);
  if (g.rank == 1) {
    g.map_inner = {0};
    return g;
  }
  g.band_step = job.block[0];
  g.bands = CeilDiv(static_cast<uint64_t>(sizes[0]), static_cast<uint64_t>(g.band_step));
  g.inner_rows = Product(sizes, 1, g.rank - 1);
  std::vector<uint64_t> grid;  // scale-grid extents of dims 1 .. rank-2
  for (size_t d = 1; d + 1 < g.rank; ++d) {
    grid.push_back(CeilDiv(static_cast<uint64_t>(sizes[d]), static_cast<uint64_t>(job.block[d])));
  }
  g.scale_rows = 1;
  for (uint64_t e : grid) g.scale_rows *= e;
  g.map_inner.resize(g.inner_rows);
  for (uint64_t m = 0; m < g.inner_rows; ++m) {
    uint64_t rest = m;
    uint64_t row = 0;
    uint64_t weight = 1;
    for (size_t d = g.rank - 1; d-- > 1;) {  // innermost of dims 1 .. rank-2 first
      const uint64_t extent = static_cast<uint64_t>(sizes[d]);
      const uint64_t index = rest % extent;
      rest /= extent;
      row += (index / static_cast<uint64_t>(job.block[d])) * weight;
      weight *= grid[d - 1];
    }
    g.map_inner[m] = static_cast<uint32_t>(row);
  }
  return g;
}

struct TensorSource {
  uint32_t piece;
  const TensorSlice* slice;
};

// Where the band's rows start in `s`, when they lie in it as evenly strided contiguous rows.
bool DirectRows(const QuantSource& source, const TensorSlice& s, const std::vector<int64_t>& off,
                const std::vector<int64_t>& sizes, const uint8_t** start, int64_t* row_stride) {
  const size_t rank = off.size();
  if (!source.data || s.buffer_strides[rank - 1] != 1) return false;
  for (size_t d = 0; d < rank; ++d) {
    if (off[d] < s.offsets[d] || off[d] + sizes[d] > s.offsets[d] + s.sizes[d]) return false;
  }
  int64_t stride = 0;
  if (rank >= 2) {
    stride = s.buffer_strides[rank - 2];
    int64_t rows_inside = sizes[rank - 2];
    for (size_t d = rank - 2; d-- > 0;) {
      if (sizes[d] > 1 && s.buffer_strides[d] != stride * rows_inside) return false;
      rows_inside *= sizes[d];
    }
  }
  int64_t element = 0;
  for (size_t d = 0; d < rank; ++d) element += (off[d] - s.offsets[d]) * s.buffer_strides[d];
  *start = source.data + s.buffer_offset + static_cast<uint64_t>(element) * DTypeSize(s.dtype);
  *row_stride = stride;
  return true;
}

// Quantizes band `band` of `job` into `slot`; returns the inf/NaN count.
absl::StatusOr<uint64_t> QuantizeBand(const std::vector<QuantSource>& sources,
                                      const std::vector<TensorSource>& of_tensor,
                                      const QuantJob& job, const Geometry& g, uint64_t band,
                                      Region& slot) {
  if (of_tensor.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", job.tensor, ": no source to quantize from"));
  }
  const DType dtype = of_tensor[0].slice->dtype;
  if (!IsFloat(dtype)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", job.tensor, ": fp8 block scales need a float source, not ", DTypeName(dtype)));
  }
  std::vector<int64_t> off = job.fp8.offsets;
  std::vector<int64_t> sizes = job.fp8.sizes;
  uint64_t rows = 1;
  if (g.rank >= 2) {
    off[0] += static_cast<int64_t>(band) * g.band_step;
    sizes[0] = std::min<int64_t>(g.band_step, job.fp8.sizes[0] - off[0] + job.fp8.offsets[0]);
    rows = static_cast<uint64_t>(sizes[0]) * g.inner_rows;
  }
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = g.map_inner[r % g.inner_rows];

  const uint8_t* src = nullptr;
  int64_t src_row_stride = 0;
  for (const TensorSource& ts : of_tensor) {
    if (DirectRows(sources[ts.piece], *ts.slice, off, sizes, &src, &src_row_stride)) break;
    src = nullptr;
  }
  std::vector<uint8_t> scratch;
  if (!src) {
    // The band spans several source slices (another sharding) or is strided: gather it, in
    // the source dtype, with a plan of its own.
    TensorSlice gathered;
    gathered.name = job.tensor;
    gathered.dtype = dtype;
    gathered.global_shape = job.fp8.global_shape;
    gathered.offsets = off;
    gathered.sizes = sizes;
    gathered.buffer_strides = RowMajorStrides(sizes);
    std::vector<plan::PlacedSlice> placed;
    for (const TensorSource& ts : of_tensor) {
      if (sources[ts.piece].data) placed.push_back({ts.slice, ts.piece, 0});
    }
    plan::PlanOptions options;
    options.multi_row_ops = true;
    auto gather = plan::BuildPlan(placed, {{&gathered, 0, 0}}, options);
    if (!gather.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", job.tensor,
                       ": cannot gather a block band to quantize: ", gather.status().message()));
    }
    scratch.resize(rows * g.cols * DTypeSize(dtype));
    std::vector<const uint8_t*> from;
    for (const QuantSource& s : sources) from.push_back(s.data);
    plan::ExecuteOnHost(*gather, from, {scratch.data()});
    src = scratch.data();
    src_row_stride = static_cast<int64_t>(g.cols);
  }
  const uint64_t band_rows_before =
      g.rank >= 2 ? band * static_cast<uint64_t>(g.band_step) * g.inner_rows : 0;
  cuda::cpu::Fp8BlockRun run;
  run.src = src;
  run.src_dtype = dtype;
  run.rows = rows;
  run.cols = g.cols;
  run.src_row_stride = src_row_stride;
  run.block_cols = g.block_cols;
  run.scale_row_of = map.data();
  run.scale_rows = g.scale_rows;
  run.dst = slot.data() + band_rows_before * g.cols;
  run.dst_row_stride = static_cast<int64_t>(g.cols);
  run.scales = reinterpret_cast<float*>(slot.data() + job.scales.buffer_offset) +
               band * g.scale_rows * g.scale_cols;
  run.scale_row_stride = static_cast<int64_t>(g.scale_cols);
  return cuda::cpu::QuantizeFp8Blocks(run);
}

}  // namespace

std::string QuantPlanName(const TensorSlice& scaled) {
  return absl::StrCat(std::string("\0q:", 3), scaled.name, std::string("\0", 1),
                      absl::StrJoin(scaled.scale_block, ","));
}

std::string ScalePlanName(const std::string& scale_tensor) {
  return absl::StrCat(std::string("\0s:", 3), scale_tensor);
}

std::vector<QuantJob> QuantJobsFor(const std::vector<const TensorSlice*>& slices) {
  std::map<std::string, QuantJob> jobs;
  for (const TensorSlice* s : slices) {
    if (!plan::IsScaled(*s)) continue;
    QuantJob job;
    job.key = absl::StrCat(s->name, "|", absl::StrJoin(s->offsets, ","), "|",
                           absl::StrJoin(s->sizes, ","), "|", absl::StrJoin(s->scale_block, ","),
                           "|", s->scale_tensor);
    if (jobs.count(job.key)) continue;
    job.tensor = s->name;
    job.block = s->scale_block;
    job.fp8.name = QuantPlanName(*s);
    job.fp8.dtype = DType::kFP8E4M3;
    job.fp8.global_shape = s->global_shape;
    job.fp8.offsets = s->offsets;
    job.fp8.sizes = s->sizes;
    job.fp8.buffer_strides = RowMajorStrides(s->sizes);
    job.scales.name = ScalePlanName(s->scale_tensor);
    job.scales.dtype = DType::kFP32;
    job.scales.global_shape = plan::ScaleShape(*s);
    plan::ScaleBox(*s, &job.scales.offsets, &job.scales.sizes);
    job.scales.buffer_strides = RowMajorStrides(job.scales.sizes);
    const uint64_t fp8_bytes = Product(s->sizes, 0, s->sizes.size());
    job.scales.buffer_offset = (fp8_bytes + 63) / 64 * 64;
    job.bytes =
        job.scales.buffer_offset + 4 * Product(job.scales.sizes, 0, job.scales.sizes.size());
    jobs.emplace(job.key, std::move(job));
  }
  std::vector<QuantJob> out;
  for (auto& [key, job] : jobs) out.push_back(std::move(job));
  return out;
}

absl::StatusOr<std::vector<std::shared_ptr<Region>>> QuantCache::Slots(
    const std::vector<QuantSource>& sources, const std::vector<QuantJob>& jobs, SlotPool& pool,
    unsigned threads, uint64_t* nonfinite_added, uint64_t* values) {
  *nonfinite_added = 0;
  *values = 0;
  std::vector<std::shared_ptr<Entry>> entries(jobs.size());
  std::vector<size_t> mine;
  {
    common::MutexLock lock(mu_);
    for (size_t i = 0; i < jobs.size(); ++i) {
      auto& entry = entries_[jobs[i].key];
      if (!entry) {
        entry = std::make_shared<Entry>();
        mine.push_back(i);
      }
      entries[i] = entry;
    }
  }
  if (!mine.empty()) {
    // Which pieces hold each tensor this call quantizes: one pass over the sources.
    std::map<std::string, std::vector<TensorSource>> of_tensor;
    for (size_t i : mine) of_tensor[jobs[i].tensor];
    for (uint32_t p = 0; p < sources.size(); ++p) {
      if (!sources[p].slices) continue;
      for (const TensorSlice& s : *sources[p].slices) {
        auto it = of_tensor.find(s.name);
        if (it != of_tensor.end()) it->second.push_back({p, &s});
      }
    }
    struct Task {
      size_t job;  // index into mine
      uint64_t band;
    };
    std::vector<Task> tasks;
    std::vector<Geometry> geometry(mine.size());
    std::vector<absl::Status> status(mine.size());
    uint64_t total = 0;
    for (size_t i : mine) total += (jobs[i].bytes + 63) / 64 * 64;
    auto slot = pool.Acquire(total);
    for (size_t m = 0, at = 0; m < mine.size(); ++m) {
      const QuantJob& job = jobs[mine[m]];
      geometry[m] = GeometryOf(job);
      if (!slot.ok()) {
        status[m] = slot.status();
        continue;
      }
      entries[mine[m]]->slot = std::make_shared<SubRegion>(*slot, at, job.bytes);
      at += (job.bytes + 63) / 64 * 64;
      for (uint64_t b = 0; b < geometry[m].bands; ++b) tasks.push_back({m, b});
      *values += Product(job.fp8.sizes, 0, job.fp8.sizes.size());
    }
    std::atomic<size_t> next{0};
    std::atomic<uint64_t> nonfinite{0};
    common::Mutex status_mu;
    auto work = [&] {
      for (size_t t; (t = next.fetch_add(1)) < tasks.size();) {
        const size_t m = tasks[t].job;
        const QuantJob& job = jobs[mine[m]];
        auto n = QuantizeBand(sources, of_tensor[job.tensor], job, geometry[m], tasks[t].band,
                              *entries[mine[m]]->slot);
        if (n.ok()) {
          nonfinite += *n;
        } else {
          common::MutexLock lock(status_mu);
          if (status[m].ok()) status[m] = n.status();
        }
      }
    };
    const unsigned count =
        static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, tasks.size())));
    std::vector<std::thread> pool_threads;
    for (unsigned t = 1; t < count; ++t) pool_threads.emplace_back(work);
    work();
    for (std::thread& t : pool_threads) t.join();
    *nonfinite_added = nonfinite.load();
    nonfinite_ += *nonfinite_added;
    common::MutexLock lock(mu_);
    for (size_t m = 0; m < mine.size(); ++m) {
      Entry& entry = *entries[mine[m]];
      entry.status = status[m];
      if (!entry.status.ok()) entry.slot.reset();
      entry.done = true;
    }
    done_.NotifyAll();
  }
  common::UniqueLock lock(mu_);
  std::vector<std::shared_ptr<Region>> out;
  for (const auto& entry : entries) {
    done_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entry->done; });
    if (!entry->status.ok()) return entry->status;
    out.push_back(entry->slot);
  }
  return out;
}

}  // namespace refit
