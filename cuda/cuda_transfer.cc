// cuda::Copy and cuda::ExecutePlan with CUDA (--config=cuda): transfer.cc's logic over CUDA
// streams and kernels.
//
// Each device has a context that lives as long as the process: its own non-blocking stream (so
// no other library's work on the legacy default stream is waited for, nor waits for ours), two
// pinned chunks for staging pageable host memory, and two device plus two pinned host scratch
// buffers for the plan executor. A call locks the contexts of the devices it touches, in
// ascending order, for its whole duration: calls on different devices run in parallel (host
// memory needs no lock: its scratch belongs to the device context), calls on one device queue.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "cuda/cuda_internal.h"
#include "cuda/gpu_kernels.h"
#include "cuda/gpu_quantize.h"
#include "cuda/kernels.h"
#include "cuda/transfer.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/dtype_convert.h"

namespace refit::cuda {
namespace {

using internal::CudaStatus;
using internal::kHost;
using internal::Place;
using internal::PlaceOf;

// Pageable host memory moves through pinned chunks of this size, two at a time, so that the
// CPU's memcpy into one overlaps the DMA out of the other.
constexpr uint64_t kChunkBytes = uint64_t{16} << 20;
// The plan executor's pieces (transfer.h): scratch per place and slot.
constexpr uint64_t kStagingBytes = uint64_t{64} << 20;

struct Buffer {
  uint8_t* data = nullptr;
  uint64_t size = 0;
};

struct PlaceContext {
  std::mutex mutex;  // held by the call using this device
  Place place = kHost;
  bool ready = false;
  cudaStream_t stream = nullptr;
  Buffer chunks[2];  // pinned staging for pageable host memory
  cudaEvent_t chunk_free[2] = {nullptr, nullptr};
  Buffer scratch[2];       // device memory
  Buffer host_scratch[2];  // pinned host memory, for the host side of this device's calls
};

// Never destroyed: CUDA may already be torn down when static destructors run.
PlaceContext& ContextOf(Place place) {
  static auto* registry_mutex = new std::mutex;
  static auto* contexts = new std::map<Place, std::unique_ptr<PlaceContext>>;
  std::lock_guard<std::mutex> lock(*registry_mutex);
  std::unique_ptr<PlaceContext>& context = (*contexts)[place];
  if (!context) {
    context = std::make_unique<PlaceContext>();
    context->place = place;
  }
  return *context;
}

// Makes `buffer` at least `bytes` long (pinned host memory for the host place).
absl::Status Grow(Place place, Buffer& buffer, uint64_t bytes) {
  if (buffer.size >= bytes) return absl::OkStatus();
  const uint64_t size = (bytes + (uint64_t{1} << 20) - 1) & ~((uint64_t{1} << 20) - 1);
  void* data = nullptr;
  if (place == kHost) {
    if (buffer.data != nullptr) cudaFreeHost(buffer.data);
    buffer = {};
    RETURN_IF_ERROR(
        CudaStatus(cudaHostAlloc(&data, size, cudaHostAllocPortable), "cudaHostAlloc (staging)"));
  } else {
    if (buffer.data != nullptr) cudaFree(buffer.data);
    buffer = {};
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, size), "cudaMalloc (staging)"));
  }
  buffer = {static_cast<uint8_t*>(data), size};
  return absl::OkStatus();
}

// Creates a device context's stream and events on first use; the caller holds its mutex.
absl::Status Prepare(PlaceContext& context) {
  if (context.ready || context.place == kHost) return absl::OkStatus();
  RETURN_IF_ERROR(internal::CheckDevice(context.place));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&context.stream, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  for (cudaEvent_t& event : context.chunk_free) {
    RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  }
  context.ready = true;
  return absl::OkStatus();
}

bool IsPinned(const void* host) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, host) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

class CudaOps final : public internal::DeviceOps {
 public:
  // Locks and prepares the contexts of the devices among `places` (at least one) for this call.
  static absl::StatusOr<std::unique_ptr<CudaOps>> Start(const std::set<Place>& places) {
    std::unique_ptr<CudaOps> ops(new CudaOps);
    for (const Place place : places) {  // ascending: concurrent calls can't deadlock
      if (place == kHost) continue;
      PlaceContext& context = ContextOf(place);
      ops->locks_.emplace_back(context.mutex);
      RETURN_IF_ERROR(Prepare(context));
      ops->contexts_[place] = &context;
    }
    return ops;
  }

  ~CudaOps() override { (void)Synchronize(); }

  absl::Status Convert(Place place, const uint8_t* src, DType src_dtype, uint8_t* dst,
                       DType dst_dtype, const ElementRun& run) override {
    RETURN_IF_ERROR(plan::CheckConvertible(src_dtype, dst_dtype));
    if (place == kHost) return cpu::Convert(src, src_dtype, dst, dst_dtype, run);
    ASSIGN_OR_RETURN(PlaceContext * context, Use(place));
    return CudaStatus(
        gpu::Convert(src, static_cast<int>(src_dtype), dst, static_cast<int>(dst_dtype), run.count,
                     run.rows, run.src_stride, run.dst_stride, run.src_row_stride,
                     run.dst_row_stride, context->stream),
        "conversion kernel");
  }

  absl::Status Copy2D(Place dst_place, uint8_t* dst, uint64_t dst_pitch, Place src_place,
                      const uint8_t* src, uint64_t src_pitch, uint64_t row_bytes,
                      uint64_t rows) override {
    if (dst_place == kHost && src_place == kHost) {
      cpu::Copy2D(dst, dst_pitch, src, src_pitch, row_bytes, rows);
      return absl::OkStatus();
    }
    // Queued on the destination device's stream, or the source's for a copy to the host.
    ASSIGN_OR_RETURN(PlaceContext * context, Use(dst_place != kHost ? dst_place : src_place));
    if (rows == 1 && dst_place == kHost && !IsPinned(dst)) {
      return StagedToHost(*context, dst, src, row_bytes);
    }
    if (rows == 1 && src_place == kHost && !IsPinned(src)) {
      return StagedFromHost(*context, dst, src, row_bytes);
    }
    return CudaStatus(gpu::Copy2D(dst, dst_pitch, src, src_pitch, row_bytes, rows, context->stream),
                      "cudaMemcpy2DAsync");
  }

  absl::StatusOr<uint8_t*> Scratch(Place place, int slot, uint64_t bytes) override {
    // Host scratch comes from the first device's context: any locked one serves, and this way
    // calls on different devices don't contend for one host buffer.
    auto it = place == kHost ? contexts_.begin() : contexts_.find(place);
    if (it == contexts_.end() || slot < 0 || slot > 1) {
      return absl::InternalError(absl::StrCat("no scratch for place ", place, " slot ", slot));
    }
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(it->first), "cudaSetDevice"));
    Buffer& buffer = place == kHost ? it->second->host_scratch[slot] : it->second->scratch[slot];
    RETURN_IF_ERROR(Grow(place, buffer, bytes));
    return buffer.data;
  }

  absl::Status Synchronize() override {
    absl::Status first = absl::OkStatus();
    for (const Place place : queued_) {
      absl::Status status = CudaStatus(cudaSetDevice(place), "cudaSetDevice");
      if (status.ok()) {
        status =
            CudaStatus(cudaStreamSynchronize(contexts_[place]->stream), "cudaStreamSynchronize");
      }
      if (first.ok()) first = status;
    }
    queued_.clear();
    return first;
  }

 private:
  CudaOps() = default;

  // The context of device `place`, made current; its stream will need a Synchronize().
  absl::StatusOr<PlaceContext*> Use(Place place) {
    auto it = contexts_.find(place);
    if (it == contexts_.end()) {
      return absl::InternalError(absl::StrCat("device ", place, " was not locked for this call"));
    }
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(place), "cudaSetDevice"));
    queued_.insert(place);
    return it->second;
  }

  // Pageable host -> device through the two pinned chunks: while chunk b's DMA runs, the CPU
  // fills the other one.
  absl::Status StagedFromHost(PlaceContext& context, uint8_t* dst, const uint8_t* src,
                              uint64_t bytes) {
    for (Buffer& chunk : context.chunks) RETURN_IF_ERROR(Grow(kHost, chunk, kChunkBytes));
    for (uint64_t done = 0, i = 0; done < bytes; done += kChunkBytes, ++i) {
      const uint64_t n = std::min(kChunkBytes, bytes - done);
      const int b = static_cast<int>(i % 2);
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(context.chunk_free[b]), "staging wait"));
      std::memcpy(context.chunks[b].data, src + done, n);
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst + done, context.chunks[b].data, n,
                                                 cudaMemcpyHostToDevice, context.stream),
                                 "cudaMemcpyAsync (host to device)"));
      RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(context.chunk_free[b], context.stream), "cudaEventRecord"));
    }
    return absl::OkStatus();
  }

  // Device -> pageable host: chunk i's DMA runs while the CPU copies out chunk i - 1.
  absl::Status StagedToHost(PlaceContext& context, uint8_t* dst, const uint8_t* src,
                            uint64_t bytes) {
    for (Buffer& chunk : context.chunks) RETURN_IF_ERROR(Grow(kHost, chunk, kChunkBytes));
    bool pending = false;
    uint64_t pending_at = 0, pending_bytes = 0;
    int pending_chunk = 0;
    auto drain = [&]() -> absl::Status {
      RETURN_IF_ERROR(
          CudaStatus(cudaEventSynchronize(context.chunk_free[pending_chunk]), "staging wait"));
      std::memcpy(dst + pending_at, context.chunks[pending_chunk].data, pending_bytes);
      return absl::OkStatus();
    };
    for (uint64_t done = 0, i = 0; done < bytes; done += kChunkBytes, ++i) {
      const uint64_t n = std::min(kChunkBytes, bytes - done);
      const int b = static_cast<int>(i % 2);
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(context.chunks[b].data, src + done, n,
                                                 cudaMemcpyDeviceToHost, context.stream),
                                 "cudaMemcpyAsync (device to host)"));
      RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(context.chunk_free[b], context.stream), "cudaEventRecord"));
      if (pending) RETURN_IF_ERROR(drain());
      pending = true;
      pending_at = done;
      pending_bytes = n;
      pending_chunk = b;
    }
    if (pending) RETURN_IF_ERROR(drain());
    return absl::OkStatus();
  }

  std::vector<std::unique_lock<std::mutex>> locks_;
  std::map<Place, PlaceContext*> contexts_;
  std::set<Place> queued_;  // devices with work queued since the last Synchronize()
};

// The places of `regions` (null entries skipped); whether any is CUDA memory.
bool CollectPlaces(const std::vector<const Region*>& regions, std::set<Place>& places) {
  bool any_cuda = false;
  for (const Region* region : regions) {
    if (region == nullptr) continue;
    places.insert(PlaceOf(*region));
    any_cuda |= region->kind() == MemoryKind::kCuda;
  }
  return any_cuda;
}

}  // namespace

absl::Status Copy(const Region& dst, uint64_t dst_offset, const Region& src, uint64_t src_offset,
                  uint64_t bytes) {
  std::set<Place> places;
  if (!CollectPlaces({&dst, &src}, places)) {
    internal::HostMemoryOps ops;
    return internal::CopyWith(ops, dst, dst_offset, src, src_offset, bytes);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CudaOps> ops, CudaOps::Start(places));
  return internal::CopyWith(*ops, dst, dst_offset, src, src_offset, bytes);
}

absl::Status ExecutePlan(const plan::Plan& plan, const std::vector<const Region*>& src,
                         const std::vector<const Region*>& dst) {
  std::set<Place> places;
  const bool src_cuda = CollectPlaces(src, places);
  const bool dst_cuda = CollectPlaces(dst, places);
  if (!src_cuda && !dst_cuda) {
    internal::HostMemoryOps ops;
    return internal::ExecutePlanWith(ops, plan, src, dst, kStagingBytes);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CudaOps> ops, CudaOps::Start(places));
  return internal::ExecutePlanWith(*ops, plan, src, dst, kStagingBytes);
}

absl::StatusOr<uint64_t> QuantizeFp8BlocksOnDevice(const std::vector<cpu::Fp8BlockRun>& runs,
                                                   int device) {
  if (runs.empty()) return uint64_t{0};
  for (const cpu::Fp8BlockRun& run : runs) RETURN_IF_ERROR(cpu::CheckFp8BlockRun(run));
  PlaceContext& context = ContextOf(device);
  std::lock_guard<std::mutex> lock(context.mutex);
  RETURN_IF_ERROR(Prepare(context));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  // One device allocation for everything the kernels read besides the runs' own memory: each
  // distinct row map, then one inf/NaN counter per run, then the amax scratch (one block grid:
  // the stream runs the runs one after another, and each run clears it first).
  std::map<const uint32_t*, uint64_t> map_at;  // host map -> bytes into the allocation
  uint64_t bytes = 0, amax_cells = 1;
  for (const cpu::Fp8BlockRun& run : runs) {
    auto [it, fresh] = map_at.emplace(run.scale_row_of, bytes);
    if (fresh) bytes += (run.rows * sizeof(uint32_t) + 255) / 256 * 256;
    const uint64_t col_blocks = (run.cols + run.block_cols - 1) / run.block_cols;
    amax_cells = std::max(amax_cells, run.scale_rows * col_blocks);
  }
  const uint64_t counters_at = bytes;
  bytes += (runs.size() * sizeof(unsigned long long) + 255) / 256 * 256;
  const uint64_t amax_at = bytes;
  bytes += amax_cells * sizeof(uint32_t);
  void* raw = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&raw, bytes), "cudaMalloc (fp8 quantization)"));
  uint8_t* base = static_cast<uint8_t*>(raw);
  auto run_all = [&]() -> absl::StatusOr<uint64_t> {
    for (const auto& [map, at] : map_at) {
      uint64_t rows = 0;
      for (const cpu::Fp8BlockRun& run : runs) {
        if (run.scale_row_of == map) rows = std::max(rows, run.rows);
      }
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(base + at, map, rows * sizeof(uint32_t),
                                                 cudaMemcpyHostToDevice, context.stream),
                                 "cudaMemcpyAsync (row map)"));
    }
    auto* counters = reinterpret_cast<unsigned long long*>(base + counters_at);
    auto* amax = reinterpret_cast<uint32_t*>(base + amax_at);
    for (size_t i = 0; i < runs.size(); ++i) {
      const cpu::Fp8BlockRun& run = runs[i];
      gpu::Fp8BlockRun g;
      g.src = run.src;
      g.src_dtype = static_cast<int>(run.src_dtype);
      g.rows = run.rows;
      g.cols = run.cols;
      g.src_row_stride = run.src_row_stride;
      g.block_cols = run.block_cols;
      g.scale_row_of = reinterpret_cast<const uint32_t*>(base + map_at.at(run.scale_row_of));
      g.scale_rows = run.scale_rows;
      g.dst = run.dst;
      g.dst_row_stride = run.dst_row_stride;
      g.scales = run.scales;
      g.scale_row_stride = run.scale_row_stride;
      RETURN_IF_ERROR(CudaStatus(gpu::QuantizeFp8Blocks(g, amax, counters + i, context.stream),
                                 "fp8 quantization kernels"));
    }
    std::vector<unsigned long long> counted(runs.size());
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(counted.data(), counters, runs.size() * sizeof(unsigned long long),
                        cudaMemcpyDeviceToHost, context.stream),
        "cudaMemcpyAsync (inf/NaN counts)"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context.stream), "cudaStreamSynchronize"));
    uint64_t nonfinite = 0;
    for (unsigned long long n : counted) nonfinite += n;
    return nonfinite;
  };
  absl::StatusOr<uint64_t> result = run_all();
  if (!result.ok()) (void)cudaStreamSynchronize(context.stream);
  absl::Status freed = CudaStatus(cudaFree(raw), "cudaFree (fp8 quantization)");
  if (result.ok() && !freed.ok()) return freed;
  return result;
}

namespace {

// The CUDA RunWriter (run_writer.h): the runs, their new bytes and a scratch of the same size
// in one device allocation of the destination's device; each call locks the device's context
// and runs on its stream, synchronized before it returns.
class CudaRunWriter final : public RunWriter {
 public:
  explicit CudaRunWriter(const Region& dst) : dst_(dst), context_(ContextOf(dst.device())) {}
  ~CudaRunWriter() override {
    if (device_ != nullptr) {
      std::lock_guard<std::mutex> lock(context_.mutex);
      (void)cudaSetDevice(dst_.device());
      (void)CudaStatus(cudaFree(device_), "cudaFree (sparse Apply scratch)");
    }
  }

  absl::Status Upload(const std::vector<ByteRun>& runs,
                      const std::vector<uint8_t>& values) override {
    RETURN_IF_ERROR(CheckRuns(runs, dst_.size(), values.size()));
    std::lock_guard<std::mutex> lock(context_.mutex);
    RETURN_IF_ERROR(Prepare(context_));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(dst_.device()), "cudaSetDevice"));
    const uint64_t runs_bytes = runs.size() * sizeof(ByteRun);
    values_at_ = (runs_bytes + 255) / 256 * 256;
    scratch_at_ = values_at_ + (values.size() + 255) / 256 * 256;
    const uint64_t bytes = scratch_at_ + values.size();
    if (device_ != nullptr) {
      RETURN_IF_ERROR(CudaStatus(cudaFree(device_), "cudaFree (sparse Apply scratch)"));
      device_ = nullptr;
    }
    void* raw = nullptr;
    RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&raw, std::max<uint64_t>(bytes, 1)), "cudaMalloc (sparse Apply)"));
    device_ = static_cast<uint8_t*>(raw);
    n_ = runs.size();
    values_bytes_ = values.size();
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(device_, runs.data(), runs_bytes, cudaMemcpyHostToDevice, context_.stream),
        "cudaMemcpyAsync (byte runs)"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device_ + values_at_, values.data(), values.size(),
                                               cudaMemcpyHostToDevice, context_.stream),
                               "cudaMemcpyAsync (new bytes)"));
    return Sync();
  }
  absl::Status SaveOld(uint8_t* old) override { return Gather(old); }
  absl::Status Scatter() override { return ScatterFrom(nullptr); }
  absl::Status ReadBack(uint8_t* landed) override { return Gather(landed); }
  absl::Status Restore(const uint8_t* old) override { return ScatterFrom(old); }

 private:
  const ByteRun* Runs() const { return reinterpret_cast<const ByteRun*>(device_); }
  absl::Status NotUploaded() const {
    return absl::FailedPreconditionError("RunWriter: nothing uploaded");
  }
  absl::Status Sync() {
    return CudaStatus(cudaStreamSynchronize(context_.stream), "cudaStreamSynchronize");
  }
  // The destination's bytes at the runs into the scratch, then into `to` (host memory).
  absl::Status Gather(uint8_t* to) {
    if (device_ == nullptr) return NotUploaded();
    std::lock_guard<std::mutex> lock(context_.mutex);
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(dst_.device()), "cudaSetDevice"));
    RETURN_IF_ERROR(
        CudaStatus(gpu::GatherRuns(device_ + scratch_at_, Runs(), n_, dst_.data(), context_.stream),
                   "GatherRuns"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(to, device_ + scratch_at_, values_bytes_,
                                               cudaMemcpyDeviceToHost, context_.stream),
                               "cudaMemcpyAsync (gathered bytes)"));
    return Sync();
  }
  // The uploaded values (`from` null), or `from` (host memory, uploaded into the scratch first),
  // written at the runs.
  absl::Status ScatterFrom(const uint8_t* from) {
    if (device_ == nullptr) return NotUploaded();
    std::lock_guard<std::mutex> lock(context_.mutex);
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(dst_.device()), "cudaSetDevice"));
    const uint8_t* values = device_ + values_at_;
    if (from != nullptr) {
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device_ + scratch_at_, from, values_bytes_,
                                                 cudaMemcpyHostToDevice, context_.stream),
                                 "cudaMemcpyAsync (saved bytes)"));
      values = device_ + scratch_at_;
    }
    RETURN_IF_ERROR(CudaStatus(gpu::ScatterRuns(dst_.data(), Runs(), n_, values, context_.stream),
                               "ScatterRuns"));
    return Sync();
  }

  const Region& dst_;
  PlaceContext& context_;
  uint8_t* device_ = nullptr;  // [runs | values | scratch], each 256-byte aligned
  uint64_t values_at_ = 0;
  uint64_t scratch_at_ = 0;
  uint64_t n_ = 0;
  uint64_t values_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RunWriter>> OpenRunWriter(const Region& dst) {
  if (dst.kind() != MemoryKind::kCuda) return OpenHostRunWriter(dst);
  RETURN_IF_ERROR(internal::CheckDevice(dst.device()));
  return std::unique_ptr<RunWriter>(new CudaRunWriter(dst));
}

}  // namespace refit::cuda
