// QuantBatch and QuantCache: a version's fp8 destinations quantized into one derived slot,
// task by task.
#include "daemon/store/quantized_slots.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda.h"
#include "cuda/quantize_kernels.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/scales.h"

namespace refit {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

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

// Where the band's rows start in the piece of `s` (bytes), when they lie in `s` as evenly
// strided contiguous rows.
bool DirectRows(const TensorSlice& s, const std::vector<int64_t>& off,
                const std::vector<int64_t>& sizes, uint64_t* start, int64_t* row_stride) {
  const size_t rank = off.size();
  if (s.buffer_strides[rank - 1] != 1) return false;
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
  *start = s.buffer_offset + static_cast<uint64_t>(element) * DTypeSize(s.dtype);
  *row_stride = stride;
  return true;
}

}  // namespace

std::string QuantPlanName(const TensorSlice& scaled) {
  return absl::StrCat(std::string("\0q:", 3), scaled.name, std::string("\0", 1),
                      absl::StrJoin(scaled.scale_block, ","));
}

std::string ScalePlanName(const std::string& scale_tensor) {
  return absl::StrCat(std::string("\0s:", 3), scale_tensor);
}

std::vector<QuantJob> QuantJobsFor(const std::vector<const TensorSlice*>& slices,
                                   std::vector<size_t>* job_of_slice) {
  using Jobs = std::map<std::string, std::pair<QuantJob, size_t>>;
  Jobs jobs;
  std::vector<Jobs::iterator> of_slice(slices.size(), jobs.end());
  for (size_t i = 0; i < slices.size(); ++i) {
    const TensorSlice* s = slices[i];
    if (!plan::IsScaled(*s)) continue;
    QuantJob job;
    job.key = absl::StrCat(s->name, "|", absl::StrJoin(s->offsets, ","), "|",
                           absl::StrJoin(s->sizes, ","), "|", absl::StrJoin(s->scale_block, ","),
                           "|", s->scale_tensor);
    auto known = jobs.find(job.key);
    if (known != jobs.end()) {
      of_slice[i] = known;
      continue;
    }
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
    std::string key = job.key;
    of_slice[i] = jobs.emplace(std::move(key), std::make_pair(std::move(job), 0)).first;
  }
  std::vector<QuantJob> out;
  out.reserve(jobs.size());
  for (auto& [key, job] : jobs) {
    job.second = out.size();
    out.push_back(std::move(job.first));
  }
  if (job_of_slice) {
    job_of_slice->assign(slices.size(), kNoJob);
    for (size_t i = 0; i < slices.size(); ++i) {
      if (of_slice[i] != jobs.end()) (*job_of_slice)[i] = of_slice[i]->second.second;
    }
  }
  return out;
}

const QuantJob* QuantBatch::Find(const std::string& key) const {
  auto it = by_key_.find(key);
  return it == by_key_.end() ? nullptr : &jobs_[it->second];
}

const QuantJob* QuantBatch::JobOf(const TensorSlice* scaled) const {
  auto it = by_slice_.find(scaled);
  return it == by_slice_.end() ? nullptr : &jobs_[it->second];
}

std::shared_ptr<const QuantBatch> QuantBatch::Make(
    const std::vector<const TensorSlice*>& scaled,
    const std::vector<const std::vector<TensorSlice>*>& pieces) {
  auto batch = std::make_shared<QuantBatch>();
  std::vector<size_t> job_of_slice;
  batch->jobs_ = QuantJobsFor(scaled, &job_of_slice);
  for (size_t i = 0; i < scaled.size(); ++i) {
    if (job_of_slice[i] != kNoJob) {
      batch->by_slice_.emplace(scaled[i], static_cast<uint32_t>(job_of_slice[i]));
    }
  }
  batch->job_errors_.resize(batch->jobs_.size());
  // Which pieces hold each tensor quantized: one pass over the layout.
  std::unordered_map<std::string, std::vector<TensorSource>> of_tensor;
  for (const QuantJob& job : batch->jobs_) of_tensor[job.tensor];
  for (uint32_t p = 0; p < pieces.size(); ++p) {
    if (!pieces[p]) continue;
    for (const TensorSlice& s : *pieces[p]) {
      auto it = of_tensor.find(s.name);
      if (it != of_tensor.end()) it->second.push_back({p, &s});
    }
  }
  std::map<std::string, Geometry> geometries;  // by box shape and block
  constexpr uint64_t kTaskBytes = 4ull << 20;  // of source per task
  uint64_t task_bytes = 0;
  for (uint32_t j = 0; j < batch->jobs_.size(); ++j) {
    QuantJob& job = batch->jobs_[j];
    batch->by_key_.emplace(job.key, j);
    // The job's place in the slot: its fp8 bytes, then its scales.
    const uint64_t at = batch->bytes_;
    job.fp8.buffer_offset = at;
    job.scales.buffer_offset += at;
    batch->bytes_ += (job.bytes + 63) / 64 * 64;
    const std::vector<TensorSource>& sources = of_tensor[job.tensor];
    if (sources.empty()) {
      batch->job_errors_[j] = absl::FailedPreconditionError(
          absl::StrCat("tensor ", job.tensor, ": no source to quantize from"));
      continue;
    }
    if (sources.size() == 1) {
      const TensorSlice& only = *sources[0].slice;
      bool holds = only.offsets.size() == job.fp8.offsets.size();
      for (size_t d = 0; holds && d < only.offsets.size(); ++d) {
        holds = only.offsets[d] <= job.fp8.offsets[d] &&
                job.fp8.offsets[d] + job.fp8.sizes[d] <= only.offsets[d] + only.sizes[d];
      }
      if (holds) {
        job.only_piece = sources[0].piece;
        job.only_index = static_cast<uint32_t>(sources[0].slice - pieces[sources[0].piece]->data());
      }
    }
    const DType dtype = sources[0].slice->dtype;
    if (!IsFloat(dtype)) {
      batch->job_errors_[j] = absl::FailedPreconditionError(absl::StrCat(
          "tensor ", job.tensor, ": fp8 block scales need a float source, not ", DTypeName(dtype)));
      continue;
    }
    const std::string shape =
        absl::StrCat(absl::StrJoin(job.fp8.sizes, ","), "|", absl::StrJoin(job.block, ","));
    auto g_it = geometries.find(shape);
    if (g_it == geometries.end()) g_it = geometries.emplace(shape, GeometryOf(job)).first;
    const Geometry& g = g_it->second;
    for (uint64_t b = 0; b < g.bands; ++b) {
      std::vector<int64_t> off = job.fp8.offsets;
      std::vector<int64_t> sizes = job.fp8.sizes;
      uint64_t rows = 1;
      if (g.rank >= 2) {
        off[0] += static_cast<int64_t>(b) * g.band_step;
        sizes[0] = std::min<int64_t>(g.band_step, job.fp8.sizes[0] - off[0] + job.fp8.offsets[0]);
        rows = static_cast<uint64_t>(sizes[0]) * g.inner_rows;
      }
      Band band;
      band.job = j;
      band.dtype = dtype;
      band.rows = rows;
      band.scale_rows = g.scale_rows;
      band.cols = g.cols;
      band.block_cols = g.block_cols;
      const uint64_t rows_before =
          g.rank >= 2 ? b * static_cast<uint64_t>(g.band_step) * g.inner_rows : 0;
      band.dst_offset = job.fp8.buffer_offset + rows_before * g.cols;
      band.scales_offset = job.scales.buffer_offset + 4 * b * g.scale_rows * g.scale_cols;
      std::vector<uint32_t>& map = batch->maps_[absl::StrCat(shape, "|", rows)];
      if (map.empty()) {
        map.resize(rows);
        for (uint64_t r = 0; r < rows; ++r) map[r] = g.map_inner[r % g.inner_rows];
      }
      band.map = map.data();
      for (const TensorSource& ts : sources) {
        Band::Direct d;
        if (DirectRows(*ts.slice, off, sizes, &d.offset, &d.row_stride)) {
          d.piece = ts.piece;
          band.direct.push_back(d);
        }
      }
      if (band.direct.empty()) {
        // The band spans several source slices (another sharding) or is strided: gather it,
        // in the source dtype, with a plan of its own, into scratch memory.
        TensorSlice gathered;
        gathered.name = job.tensor;
        gathered.dtype = dtype;
        gathered.global_shape = job.fp8.global_shape;
        gathered.offsets = off;
        gathered.sizes = sizes;
        gathered.buffer_strides = RowMajorStrides(sizes);
        std::vector<plan::PlacedSlice> placed;
        for (const TensorSource& ts : sources) placed.push_back({ts.slice, ts.piece, 0});
        plan::PlanOptions options;
        options.multi_row_ops = true;
        auto gather = plan::BuildPlan(placed, {{&gathered, 0, 0}}, options);
        if (!gather.ok()) {
          batch->job_errors_[j] = absl::FailedPreconditionError(absl::StrCat(
              "tensor ", job.tensor,
              ": cannot gather a block band to quantize: ", gather.status().message()));
          break;
        }
        std::set<uint32_t> read;
        for (const plan::CopyOp& op : gather->ops) read.insert(op.src_location);
        band.gather_pieces.assign(read.begin(), read.end());
        band.gather = std::make_shared<const plan::Plan>(std::move(gather).value());
      }
      // A task reads one piece (a gathered band is a task of its own) and a few MiB of it.
      const uint64_t bytes = rows * g.cols * DTypeSize(dtype);
      const bool direct = !band.direct.empty();
      const bool join = !batch->tasks_.empty() && direct && task_bytes < kTaskBytes &&
                        !batch->bands_[batch->tasks_.back().first_band].gather &&
                        batch->tasks_.back().pieces[0] == band.direct[0].piece;
      if (!join) {
        Task task;
        task.first_band = batch->bands_.size();
        if (direct) {
          task.pieces = {band.direct[0].piece};
        } else {
          task.pieces = band.gather_pieces;
        }
        batch->tasks_.push_back(std::move(task));
        task_bytes = 0;
      }
      task_bytes += bytes;
      // The bytes the band reads, for a task to wait on while a pull lands them.
      std::vector<Extent>& extents = batch->tasks_.back().extents;
      auto add = [&extents](uint32_t piece, uint64_t begin, uint64_t end) {
        if (!extents.empty() && extents.back().piece == piece && begin >= extents.back().begin &&
            begin <= extents.back().end) {
          extents.back().end = std::max(extents.back().end, end);
        } else {
          extents.push_back({piece, begin, end});
        }
      };
      const uint64_t elem = DTypeSize(dtype);
      if (direct) {
        const Band::Direct& d = band.direct[0];
        const uint64_t row_bytes =
            d.row_stride > 0 ? static_cast<uint64_t>(d.row_stride) * elem : 0;
        add(d.piece, d.offset, d.offset + (rows - 1) * row_bytes + g.cols * elem);
      } else {
        for (const plan::CopyOp& op : band.gather->ops) {
          const uint64_t last = (op.rows - 1) * static_cast<uint64_t>(op.src_row_stride) +
                                (op.count - 1) * static_cast<uint64_t>(op.src_stride) + 1;
          add(op.src_location, op.src_offset, op.src_offset + last * elem);
        }
      }
      batch->bands_.push_back(std::move(band));
      batch->tasks_.back().end_band = batch->bands_.size();
    }
  }
  return batch;
}

namespace {

// The kernel's run for `band` read from `src` (rows `row_stride` elements apart) into `slot`.
cuda::cpu::Fp8BlockRun BandRun(const QuantBatch::Band& band, const uint8_t* src, int64_t row_stride,
                               uint8_t* slot) {
  cuda::cpu::Fp8BlockRun run;
  run.src = src;
  run.src_dtype = band.dtype;
  run.rows = band.rows;
  run.cols = band.cols;
  run.src_row_stride = row_stride;
  run.block_cols = band.block_cols;
  run.scale_row_of = band.map;
  run.scale_rows = band.scale_rows;
  run.dst = slot + band.dst_offset;
  run.dst_row_stride = static_cast<int64_t>(band.cols);
  run.scales = reinterpret_cast<float*>(slot + band.scales_offset);
  run.scale_row_stride = static_cast<int64_t>(CeilDiv(band.cols, band.block_cols));
  return run;
}

absl::Status NotHeld(const QuantJob& job) {
  return absl::FailedPreconditionError(
      absl::StrCat("tensor ", job.tensor, ": its source bytes are not held on this node"));
}

// Where a direct band's rows are in `sources` (the first of its pieces that is here); null when
// none is.
const QuantBatch::Band::Direct* DirectSource(const QuantBatch::Band& band,
                                             const std::vector<QuantSource>& sources) {
  for (const QuantBatch::Band::Direct& d : band.direct) {
    if (d.piece < sources.size() && sources[d.piece].data) return &d;
  }
  return nullptr;
}

// Runs `band` of a batch from `sources` (host memory) into `slot`; returns the inf/NaN count.
absl::StatusOr<uint64_t> RunBand(const QuantBatch::Band& band, const QuantJob& job,
                                 const std::vector<QuantSource>& sources, uint8_t* slot) {
  const uint8_t* src = nullptr;
  int64_t row_stride = static_cast<int64_t>(band.cols);
  std::vector<uint8_t> scratch;
  if (!band.direct.empty()) {
    const QuantBatch::Band::Direct* d = DirectSource(band, sources);
    if (!d) return NotHeld(job);
    src = sources[d->piece].data + d->offset;
    row_stride = d->row_stride;
  } else {
    std::vector<const uint8_t*> from;
    for (const QuantSource& s : sources) from.push_back(s.data);
    for (uint32_t p : band.gather_pieces) {
      if (p >= from.size() || !from[p]) return NotHeld(job);
    }
    scratch.resize(band.rows * band.cols * DTypeSize(band.dtype));
    plan::ExecuteOnHost(*band.gather, from, {scratch.data()});
    src = scratch.data();
  }
  return cuda::cpu::QuantizeFp8Blocks(BandRun(band, src, row_stride, slot));
}

// Runs the bands of `task` on GPU `device`: `sources` are GPU slots there and so is `slot`. A
// gathered band is gathered into device scratch first (cuda::ExecutePlan). Returns the inf/NaN
// count; `values` gets the values quantized.
absl::StatusOr<uint64_t> RunTaskOnDevice(const QuantBatch& batch, const QuantBatch::Task& task,
                                         const std::vector<QuantSource>& sources, Region& slot,
                                         int device, uint64_t* values) {
  std::vector<cuda::cpu::Fp8BlockRun> runs;
  std::vector<std::unique_ptr<Region>> scratch;  // until the runs are done
  for (size_t b = task.first_band; b < task.end_band; ++b) {
    const QuantBatch::Band& band = batch.bands()[b];
    const QuantJob& job = batch.jobs()[band.job];
    if (!band.direct.empty()) {
      const QuantBatch::Band::Direct* d = DirectSource(band, sources);
      if (!d) return NotHeld(job);
      runs.push_back(BandRun(band, sources[d->piece].data + d->offset, d->row_stride, slot.data()));
    } else {
      std::vector<const Region*> from;
      for (const QuantSource& s : sources) from.push_back(s.data ? s.region : nullptr);
      for (uint32_t p : band.gather_pieces) {
        if (p >= from.size() || !from[p]) return NotHeld(job);
      }
      const uint64_t bytes = band.rows * band.cols * DTypeSize(band.dtype);
      auto region = cuda::AllocateDevice(std::max<uint64_t>(bytes, 1), device);
      if (!region.ok()) return region.status();
      RETURN_IF_ERROR(cuda::ExecutePlan(*band.gather, from, {region->get()}));
      runs.push_back(
          BandRun(band, (*region)->data(), static_cast<int64_t>(band.cols), slot.data()));
      scratch.push_back(std::move(region).value());
    }
    *values += band.rows * band.cols;
  }
  return cuda::QuantizeFp8BlocksOnDevice(runs, device);
}

// Whether every byte `task` reads is here: its pieces present, and landed where a pull is still
// bringing them.
bool Landed(const QuantBatch::Task& task, const std::vector<QuantSource>& sources) {
  for (uint32_t p : task.pieces) {
    if (p >= sources.size() || !sources[p].data) return false;
  }
  for (const QuantBatch::Extent& e : task.extents) {
    if (e.piece >= sources.size() || !sources[e.piece].data) return false;
    const auto* landed = sources[e.piece].landed;
    if (!landed) continue;
    // The landed range holding e.begin must reach e.end.
    auto it =
        std::upper_bound(landed->begin(), landed->end(), std::make_pair(e.begin, ~uint64_t{0}));
    if (it == landed->begin()) return false;
    --it;
    if (it->first > e.begin || it->second < e.end) return false;
  }
  return true;
}

}  // namespace

std::shared_ptr<Region> QuantCache::Slot(const QuantBatch* batch) {
  std::shared_ptr<Entry> entry;
  {
    common::MutexLock lock(mu_);
    auto it = entries_.find(batch);
    if (it == entries_.end()) return nullptr;
    entry = it->second;
  }
  common::MutexLock run(entry->run_mu);
  return entry->finished && entry->status.ok() ? entry->slot : nullptr;
}

void QuantCache::SetChanges(const QuantBatch* batch, DerivedChanges changes) {
  common::MutexLock lock(mu_);
  auto it = entries_.find(batch);
  if (it != entries_.end()) it->second->changes = std::move(changes);
}

DerivedChanges QuantCache::Changes(const QuantBatch* batch) {
  common::MutexLock lock(mu_);
  auto it = entries_.find(batch);
  return it == entries_.end() ? DerivedChanges{} : it->second->changes;
}

void QuantCache::Forget(const QuantBatch& batch, uint32_t piece,
                        const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::shared_ptr<Entry> entry;
  {
    common::MutexLock lock(mu_);
    auto it = entries_.find(&batch);
    if (it == entries_.end()) return;
    entry = it->second;
  }
  common::MutexLock run(entry->run_mu);
  if (entry->finished) return;
  for (size_t t = 0; t < batch.tasks().size(); ++t) {
    if (!entry->done[t]) continue;
    bool touched = false;
    for (const QuantBatch::Extent& e : batch.tasks()[t].extents) {
      for (const auto& [begin, end] : ranges) {
        touched = touched || (e.piece == piece && begin < e.end && e.begin < end);
      }
    }
    if (!touched) continue;
    entry->done[t] = 0;
    ++entry->left;
    nonfinite_ -= entry->nonfinite[t];
    entry->nonfinite[t] = 0;
  }
}

absl::StatusOr<std::shared_ptr<Region>> QuantCache::Run(
    const std::shared_ptr<const QuantBatch>& batch, const std::vector<QuantSource>& sources,
    SlotPool& pool, unsigned threads, bool partial, uint64_t* nonfinite_added, uint64_t* values,
    int device, size_t max_tasks, size_t* runnable_left) {
  *nonfinite_added = 0;
  *values = 0;
  if (runnable_left) *runnable_left = 0;
  std::shared_ptr<Entry> entry;
  {
    common::MutexLock lock(mu_);
    std::shared_ptr<Entry>& e = entries_[batch.get()];
    if (!e) {
      e = std::make_shared<Entry>();
      e->batch = batch;
      e->done.assign(batch->tasks().size(), 0);
      e->nonfinite.assign(batch->tasks().size(), 0);
      e->left = batch->tasks().size();
    }
    entry = e;
  }
  common::MutexLock run(entry->run_mu);
  auto finish = [&]() -> absl::StatusOr<std::shared_ptr<Region>> {
    if (!entry->status.ok()) return entry->status;
    return entry->finished ? entry->slot : nullptr;
  };
  if (entry->finished) return finish();
  for (size_t j = 0; j < batch->jobs().size(); ++j) {
    if (!batch->job_error(j).ok()) {
      entry->status = batch->job_error(j);
      entry->finished = true;
      return finish();
    }
  }
  if (!entry->slot) {
    auto slot = pool.Acquire(std::max<uint64_t>(64, batch->bytes()));
    if (!slot.ok()) {
      entry->status = slot.status();
      entry->finished = true;
      return finish();
    }
    entry->slot = *slot;
  }
  std::vector<size_t> runnable;
  for (size_t t = 0; t < batch->tasks().size(); ++t) {
    if (entry->done[t]) continue;
    if (!partial || Landed(batch->tasks()[t], sources)) runnable.push_back(t);
  }
  if (partial && runnable.size() > max_tasks) {
    if (runnable_left) *runnable_left = runnable.size() - max_tasks;
    runnable.resize(max_tasks);
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> quantized{0};
  common::Mutex status_mu;
  absl::Status status;
  uint8_t* slot = entry->slot->data();
  std::vector<uint64_t>& task_nonfinite = entry->nonfinite;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < runnable.size();) {
      const QuantBatch::Task& task = batch->tasks()[runnable[i]];
      uint64_t counted = 0;
      for (size_t b = task.first_band; b < task.end_band; ++b) {
        const QuantBatch::Band& band = batch->bands()[b];
        auto n = RunBand(band, batch->jobs()[band.job], sources, slot);
        if (n.ok()) {
          counted += *n;
          quantized += band.rows * band.cols;
        } else {
          common::MutexLock lock(status_mu);
          if (status.ok()) status = n.status();
        }
      }
      task_nonfinite[runnable[i]] = counted;
    }
  };
  if (device != kOnHost) {
    // One device: its stream runs one task after another anyway.
    for (size_t t : runnable) {
      uint64_t task_values = 0;
      auto n =
          RunTaskOnDevice(*batch, batch->tasks()[t], sources, *entry->slot, device, &task_values);
      if (!n.ok()) {
        if (status.ok()) status = n.status();
        continue;
      }
      task_nonfinite[t] = *n;
      quantized += task_values;
    }
  } else {
    const unsigned count =
        static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, runnable.size())));
    std::vector<std::thread> pool_threads;
    for (unsigned t = 1; t < count; ++t) pool_threads.emplace_back(work);
    work();
    for (std::thread& t : pool_threads) t.join();
  }
  uint64_t nonfinite = 0;
  for (size_t t : runnable) {
    entry->done[t] = 1;
    nonfinite += entry->nonfinite[t];
  }
  entry->left -= runnable.size();
  *nonfinite_added = nonfinite;
  *values = quantized.load();
  nonfinite_ += *nonfinite_added;
  if (!status.ok()) entry->status = status;
  if (!status.ok() || entry->left == 0) {
    entry->finished = true;
    if (!entry->status.ok()) entry->slot.reset();
  }
  return finish();
}

}  // namespace refit
