// GPU kernels of gpu_kernels.h. Memory-bound by design: every kernel reads and writes each byte
// once where it can, in 16-byte vectors when the pointers allow it.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/float_bits.h"
#include "cuda/gpu_kernels.h"

namespace refit::cuda::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Change detection looks at 16-byte units (one uint4 per input); a tile is what one block of
// FindChanges covers: 8 units per thread, 32 KiB of each input.
constexpr uint64_t kUnitBytes = 16;
constexpr int kUnitsPerThread = 8;
constexpr uint64_t kTileUnits = kThreads * kUnitsPerThread;
// Grid-stride kernels launch at most this many blocks (a few waves on an H200's 132 SMs).
constexpr uint64_t kMaxBlocks = 4096;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

bool Aligned(const void* p, uint64_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

cudaError_t LaunchError() { return cudaGetLastError(); }

// ---- block-wide sums and scans (kThreads threads) ----

// Sum over the block; the result is valid in every thread.
template <typename T>
__device__ T BlockSum(T value, T* shared /* kWarps entries */) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < kWarps; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// Exclusive prefix sum over the block in thread order; *total gets the block's sum.
template <typename T>
__device__ T BlockExclusiveScan(T value, T* total, T* shared /* kWarps entries */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  T before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += shared[w];
    sum += shared[w];
  }
  __syncthreads();
  *total = sum;
  return before + inclusive - value;
}

// ---- change detection ----

// Bit e of the result: element e of the 16-byte unit differs. `d` is base ^ target of the unit
// as four little-endian words.
template <int kSize>
__device__ uint32_t UnitMaskFromXor(const uint32_t d[4]) {
  uint32_t mask = 0;
  if constexpr (kSize == 1) {
    for (int w = 0; w < 4; ++w)
      for (int k = 0; k < 4; ++k)
        mask |= (((d[w] >> (8 * k)) & 0xffu) != 0 ? 1u : 0u) << (4 * w + k);
  } else if constexpr (kSize == 2) {
    for (int w = 0; w < 4; ++w)
      for (int k = 0; k < 2; ++k)
        mask |= (((d[w] >> (16 * k)) & 0xffffu) != 0 ? 1u : 0u) << (2 * w + k);
  } else if constexpr (kSize == 4) {
    for (int w = 0; w < 4; ++w) mask |= (d[w] != 0 ? 1u : 0u) << w;
  } else {
    mask = ((d[0] | d[1]) != 0 ? 1u : 0u) | ((d[2] | d[3]) != 0 ? 2u : 0u);
  }
  return mask;
}

// The mask of a unit the vector path can't take (the last, partial one, or unaligned inputs):
// element by element, byte by byte.
template <int kSize>
__device__ uint32_t UnitMaskSlow(const uint8_t* base, const uint8_t* target, uint64_t unit,
                                 uint64_t num_elements) {
  constexpr int kPerUnit = kUnitBytes / kSize;
  uint32_t mask = 0;
  for (int e = 0; e < kPerUnit; ++e) {
    const uint64_t element = unit * kPerUnit + e;
    if (element >= num_elements) break;
    bool differs = false;
    for (int b = 0; b < kSize; ++b)
      differs |= base[element * kSize + b] != target[element * kSize + b];
    mask |= (differs ? 1u : 0u) << e;
  }
  return mask;
}

// Pass 1: one block per tile writes each unit's mask and the tile's count of changed elements.
// Units past the end get mask 0, so pass 3 may read whole tiles.
template <int kSize, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    MarkKernel(const uint8_t* base, const uint8_t* target, uint64_t num_elements,
               uint64_t num_units, uint64_t full_units, uint16_t* masks, uint64_t* tile_counts) {
  __shared__ uint32_t shared[kWarps];
  const uint64_t first = blockIdx.x * kTileUnits + threadIdx.x;
  uint4 a[kUnitsPerThread], b[kUnitsPerThread];
  if constexpr (kAligned) {
    // All loads first, so that sixteen 16-byte loads per thread are in flight at once.
#pragma unroll
    for (int j = 0; j < kUnitsPerThread; ++j) {
      const uint64_t unit = first + j * kThreads;
      if (unit < full_units) {
        a[j] = reinterpret_cast<const uint4*>(base)[unit];
        b[j] = reinterpret_cast<const uint4*>(target)[unit];
      }
    }
  }
  uint32_t count = 0;
#pragma unroll
  for (int j = 0; j < kUnitsPerThread; ++j) {
    const uint64_t unit = first + j * kThreads;
    uint32_t mask = 0;
    if (kAligned && unit < full_units) {
      const uint32_t d[4] = {a[j].x ^ b[j].x, a[j].y ^ b[j].y, a[j].z ^ b[j].z, a[j].w ^ b[j].w};
      mask = UnitMaskFromXor<kSize>(d);
    } else if (unit < num_units) {
      mask = UnitMaskSlow<kSize>(base, target, unit, num_elements);
    }
    masks[unit] = static_cast<uint16_t>(mask);
    count += __popc(mask);
  }
  const uint32_t total = BlockSum<uint32_t>(count, shared);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

// Pass 2, one block: tile counts -> exclusive offsets in place; *count = the sum. Each thread
// takes kScanItems consecutive tiles per round, so a 1 GiB input (32 Ki tiles) takes 8 rounds.
constexpr int kScanItems = 16;

__global__ void __launch_bounds__(kThreads)
    ScanTilesKernel(uint64_t* tiles, uint64_t num_tiles, uint64_t* count) {
  __shared__ unsigned long long shared[kWarps];
  unsigned long long carry = 0;
  for (uint64_t start = 0; start < num_tiles; start += uint64_t{kThreads} * kScanItems) {
    const uint64_t first = start + threadIdx.x * uint64_t{kScanItems};
    unsigned long long items[kScanItems];
    unsigned long long mine = 0;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      items[k] = first + k < num_tiles ? tiles[first + k] : 0;
      mine += items[k];
    }
    unsigned long long sum = 0;
    unsigned long long running = carry + BlockExclusiveScan(mine, &sum, shared);
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      if (first + k < num_tiles) tiles[first + k] = running;
      running += items[k];
    }
    carry += sum;
  }
  if (threadIdx.x == 0) *count = carry;
}

// Pass 3: one block per tile turns the tile's masks into positions, in order. Each thread owns
// kUnitsPerThread consecutive units: one 16-byte load of masks.
__global__ void __launch_bounds__(kThreads)
    EmitKernel(const uint16_t* masks, const uint64_t* tile_offsets, uint64_t num_tiles,
               const uint64_t* count, uint64_t elements_per_unit, uint64_t* positions,
               uint64_t capacity) {
  static_assert(kUnitsPerThread * sizeof(uint16_t) == sizeof(uint4));
  __shared__ uint32_t shared[kWarps];
  const uint64_t tile = blockIdx.x;
  const uint64_t offset = tile_offsets[tile];
  const uint64_t end = tile + 1 < num_tiles ? tile_offsets[tile + 1] : *count;
  if (offset == end || offset >= capacity) return;  // block-uniform: no change, or no room
  const uint64_t first_unit = tile * kTileUnits + threadIdx.x * uint64_t{kUnitsPerThread};
  const uint4 packed = reinterpret_cast<const uint4*>(masks)[first_unit / kUnitsPerThread];
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
  uint32_t mine = 0;
  for (int w = 0; w < 4; ++w) mine += __popc(words[w]);
  uint32_t unused = 0;
  uint64_t out = offset + BlockExclusiveScan<uint32_t>(mine, &unused, shared);
  for (int k = 0; k < kUnitsPerThread; ++k) {
    uint32_t mask = (words[k / 2] >> (16 * (k % 2))) & 0xffffu;
    while (mask != 0 && out < capacity) {
      const int bit = __ffs(mask) - 1;
      mask &= mask - 1;
      positions[out++] = (first_unit + k) * elements_per_unit + bit;
    }
  }
}

template <int kSize>
cudaError_t LaunchMark(const uint8_t* base, const uint8_t* target, uint64_t num_elements,
                       uint64_t num_units, uint64_t num_tiles, uint16_t* masks,
                       uint64_t* tile_counts, cudaStream_t stream) {
  const uint64_t bytes = num_elements * kSize;
  if (Aligned(base, kUnitBytes) && Aligned(target, kUnitBytes)) {
    MarkKernel<kSize, true><<<static_cast<unsigned>(num_tiles), kThreads, 0, stream>>>(
        base, target, num_elements, num_units, bytes / kUnitBytes, masks, tile_counts);
  } else {
    MarkKernel<kSize, false><<<static_cast<unsigned>(num_tiles), kThreads, 0, stream>>>(
        base, target, num_elements, num_units, 0, masks, tile_counts);
  }
  return LaunchError();
}

// ---- gather / scatter ----

// Loads and stores of one element; byte by byte where the pointer may be misaligned.
template <typename T, bool kAligned>
__device__ T LoadElement(const uint8_t* at) {
  if constexpr (kAligned) {
    return *reinterpret_cast<const T*>(at);
  } else {
    T value = 0;
    for (int b = 0; b < static_cast<int>(sizeof(T)); ++b) value |= static_cast<T>(at[b]) << (8 * b);
    return value;
  }
}

template <typename T, bool kAligned>
__device__ void StoreElement(uint8_t* at, T value) {
  if constexpr (kAligned) {
    *reinterpret_cast<T*>(at) = value;
  } else {
    for (int b = 0; b < static_cast<int>(sizeof(T)); ++b)
      at[b] = static_cast<uint8_t>(value >> (8 * b));
  }
}

enum class Scatter { kGatherValues, kScatterValues, kGatherDiffs, kScatterAddDiffs };

// One thread per position. `a` is the indexed buffer (base for kGatherDiffs), `b` the target
// for kGatherDiffs, `packed` the values or diffs.
template <Scatter kOp, typename T, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    PositionsKernel(uint8_t* a, const uint8_t* b, const uint64_t* positions, uint8_t* packed,
                    uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{kThreads} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * kThreads) {
    uint8_t* element = a + positions[i] * sizeof(T);
    uint8_t* slot = packed + i * sizeof(T);
    if constexpr (kOp == Scatter::kGatherValues) {
      StoreElement<T, kAligned>(slot, LoadElement<T, kAligned>(element));
    } else if constexpr (kOp == Scatter::kScatterValues) {
      StoreElement<T, kAligned>(element, LoadElement<T, kAligned>(slot));
    } else if constexpr (kOp == Scatter::kGatherDiffs) {
      const T target = LoadElement<T, kAligned>(b + positions[i] * sizeof(T));
      StoreElement<T, kAligned>(slot, static_cast<T>(target - LoadElement<T, kAligned>(element)));
    } else {
      const T sum = LoadElement<T, kAligned>(element) + LoadElement<T, kAligned>(slot);
      StoreElement<T, kAligned>(element, static_cast<T>(sum));
    }
  }
}

template <Scatter kOp, typename T>
cudaError_t LaunchPositionsTyped(uint8_t* a, const uint8_t* b, const uint64_t* positions,
                                 uint8_t* packed, uint64_t n, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(std::min(CeilDiv(n, kThreads), kMaxBlocks));
  if (Aligned(a, sizeof(T)) && Aligned(b, sizeof(T)) && Aligned(packed, sizeof(T))) {
    PositionsKernel<kOp, T, true><<<blocks, kThreads, 0, stream>>>(a, b, positions, packed, n);
  } else {
    PositionsKernel<kOp, T, false><<<blocks, kThreads, 0, stream>>>(a, b, positions, packed, n);
  }
  return LaunchError();
}

template <Scatter kOp>
cudaError_t LaunchPositions(uint8_t* a, const uint8_t* b, uint64_t element_size,
                            const uint64_t* positions, uint8_t* packed, uint64_t n,
                            cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (element_size) {
    case 1:
      return LaunchPositionsTyped<kOp, uint8_t>(a, b, positions, packed, n, stream);
    case 2:
      return LaunchPositionsTyped<kOp, uint16_t>(a, b, positions, packed, n, stream);
    case 4:
      return LaunchPositionsTyped<kOp, uint32_t>(a, b, positions, packed, n, stream);
    case 8:
      return LaunchPositionsTyped<kOp, uint64_t>(a, b, positions, packed, n, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// ---- conversion and strided copies ----

// The raw storage type of each float dtype code.
template <int kCode>
struct Raw;
template <>
struct Raw<bits::kBF16> {
  using Type = uint16_t;
};
template <>
struct Raw<bits::kFP16> {
  using Type = uint16_t;
};
template <>
struct Raw<bits::kFP32> {
  using Type = uint32_t;
};
template <>
struct Raw<bits::kE4M3> {
  using Type = uint8_t;
};
template <>
struct Raw<bits::kE5M2> {
  using Type = uint8_t;
};

// Where the elements of a 2-D run are. A grid-stride loop walks the flat index
// i = row * count + column; instead of dividing per element, each thread advances
// (row, column) by the grid's stride, pre-split into rows and columns on the host.
struct RunGeometry {
  uint64_t count, total;
  int64_t src_stride, dst_stride, src_row_stride, dst_row_stride;
  uint64_t step, step_rows, step_columns;
};

// Converts (or, with identical types and kCopy, copies) each element of the run.
template <typename Src, typename Dst, int kFrom, int kTo, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    RunKernel(const uint8_t* src, uint8_t* dst, RunGeometry g) {
  uint64_t i = blockIdx.x * uint64_t{kThreads} + threadIdx.x;
  if (i >= g.total) return;
  uint64_t row = i / g.count, column = i % g.count;
  for (; i < g.total; i += g.step) {
    const int64_t r = static_cast<int64_t>(row), c = static_cast<int64_t>(column);
    const Src raw = LoadElement<Src, kAligned>(src + (r * g.src_row_stride + c * g.src_stride) *
                                                         static_cast<int64_t>(sizeof(Src)));
    Dst out;
    if constexpr (kFrom == 0) {
      out = raw;  // a plain copy of any element type
    } else {
      out = static_cast<Dst>(bits::ConvertBits<kFrom, kTo>(raw));
    }
    StoreElement<Dst, kAligned>(
        dst + (r * g.dst_row_stride + c * g.dst_stride) * static_cast<int64_t>(sizeof(Dst)), out);
    row += g.step_rows;
    column += g.step_columns;
    if (column >= g.count) {
      column -= g.count;
      ++row;
    }
  }
}

template <typename Src, typename Dst, int kFrom, int kTo>
cudaError_t LaunchRun(const uint8_t* src, uint8_t* dst, RunGeometry g, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(std::min(CeilDiv(g.total, kThreads), kMaxBlocks));
  g.step = uint64_t{blocks} * kThreads;
  g.step_rows = g.step / g.count;
  g.step_columns = g.step % g.count;
  if (Aligned(src, sizeof(Src)) && Aligned(dst, sizeof(Dst))) {
    RunKernel<Src, Dst, kFrom, kTo, true><<<blocks, kThreads, 0, stream>>>(src, dst, g);
  } else {
    RunKernel<Src, Dst, kFrom, kTo, false><<<blocks, kThreads, 0, stream>>>(src, dst, g);
  }
  return LaunchError();
}

template <int kFrom>
cudaError_t LaunchConvertTo(int to, const uint8_t* src, uint8_t* dst, const RunGeometry& g,
                            cudaStream_t stream) {
  using Src = typename Raw<kFrom>::Type;
  switch (to) {
    case bits::kBF16:
      return LaunchRun<Src, uint16_t, kFrom, bits::kBF16>(src, dst, g, stream);
    case bits::kFP16:
      return LaunchRun<Src, uint16_t, kFrom, bits::kFP16>(src, dst, g, stream);
    case bits::kFP32:
      return LaunchRun<Src, uint32_t, kFrom, bits::kFP32>(src, dst, g, stream);
    case bits::kE4M3:
      return LaunchRun<Src, uint8_t, kFrom, bits::kE4M3>(src, dst, g, stream);
    case bits::kE5M2:
      return LaunchRun<Src, uint8_t, kFrom, bits::kE5M2>(src, dst, g, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// Bytes per element of a refit::DType value (types.h), for the plain copies.
uint64_t DTypeBytes(int dtype) {
  switch (dtype) {
    case 1:  // bf16
    case 2:  // fp16
      return 2;
    case 3:  // fp32
    case 8:  // int32
      return 4;
    case 4:  // fp8 e4m3
    case 5:  // fp8 e5m2
    case 6:  // int8
    case 7:  // uint8
      return 1;
    case 9:  // int64
      return 8;
    default:
      return 0;
  }
}

bool IsFloatCode(int dtype) { return dtype >= bits::kBF16 && dtype <= bits::kE5M2; }

__global__ void __launch_bounds__(kThreads)
    ReadWriteKernel(const uint4* a, const uint4* b, uint4* out, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{kThreads} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * kThreads) {
    const uint4 x = a[i], y = b[i];
    out[i] = make_uint4(x.x ^ y.x, x.y ^ y.y, x.z ^ y.z, x.w ^ y.w);
  }
}

}  // namespace

uint64_t FindChangesScratchBytes(uint64_t num_elements, uint64_t element_size) {
  const uint64_t tiles = CeilDiv(CeilDiv(num_elements * element_size, kUnitBytes), kTileUnits);
  return tiles * kTileUnits * sizeof(uint16_t) + tiles * sizeof(uint64_t);
}

cudaError_t FindChanges(const uint8_t* base, const uint8_t* target, uint64_t num_elements,
                        uint64_t element_size, uint64_t* positions, uint64_t capacity,
                        uint64_t* count, void* scratch, cudaStream_t stream) {
  if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8) {
    return cudaErrorInvalidValue;
  }
  if (num_elements == 0) return cudaMemsetAsync(count, 0, sizeof(uint64_t), stream);
  const uint64_t num_units = CeilDiv(num_elements * element_size, kUnitBytes);
  const uint64_t num_tiles = CeilDiv(num_units, kTileUnits);
  auto* masks = static_cast<uint16_t*>(scratch);
  auto* tiles = reinterpret_cast<uint64_t*>(masks + num_tiles * kTileUnits);
  cudaError_t status;
  switch (element_size) {
    case 1:
      status =
          LaunchMark<1>(base, target, num_elements, num_units, num_tiles, masks, tiles, stream);
      break;
    case 2:
      status =
          LaunchMark<2>(base, target, num_elements, num_units, num_tiles, masks, tiles, stream);
      break;
    case 4:
      status =
          LaunchMark<4>(base, target, num_elements, num_units, num_tiles, masks, tiles, stream);
      break;
    default:
      status =
          LaunchMark<8>(base, target, num_elements, num_units, num_tiles, masks, tiles, stream);
      break;
  }
  if (status != cudaSuccess) return status;
  ScanTilesKernel<<<1, kThreads, 0, stream>>>(tiles, num_tiles, count);
  if ((status = LaunchError()) != cudaSuccess) return status;
  EmitKernel<<<static_cast<unsigned>(num_tiles), kThreads, 0, stream>>>(
      masks, tiles, num_tiles, count, kUnitBytes / element_size, positions, capacity);
  return LaunchError();
}

cudaError_t GatherValues(const uint8_t* src, uint64_t element_size, const uint64_t* positions,
                         uint64_t n, uint8_t* values, cudaStream_t stream) {
  // The indexed buffer is only read here; PositionsKernel takes it non-const for the scatters.
  return LaunchPositions<Scatter::kGatherValues>(const_cast<uint8_t*>(src), src, element_size,
                                                 positions, values, n, stream);
}

cudaError_t ScatterValues(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                          const uint8_t* values, uint64_t n, cudaStream_t stream) {
  return LaunchPositions<Scatter::kScatterValues>(dst, dst, element_size, positions,
                                                  const_cast<uint8_t*>(values), n, stream);
}

cudaError_t GatherDiffs(const uint8_t* base, const uint8_t* target, uint64_t element_size,
                        const uint64_t* positions, uint64_t n, uint8_t* diffs,
                        cudaStream_t stream) {
  return LaunchPositions<Scatter::kGatherDiffs>(const_cast<uint8_t*>(base), target, element_size,
                                                positions, diffs, n, stream);
}

cudaError_t ScatterAddDiffs(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                            const uint8_t* diffs, uint64_t n, cudaStream_t stream) {
  return LaunchPositions<Scatter::kScatterAddDiffs>(dst, dst, element_size, positions,
                                                    const_cast<uint8_t*>(diffs), n, stream);
}

cudaError_t Convert(const uint8_t* src, int src_dtype, uint8_t* dst, int dst_dtype, uint64_t count,
                    uint64_t rows, int64_t src_stride, int64_t dst_stride, int64_t src_row_stride,
                    int64_t dst_row_stride, cudaStream_t stream) {
  const bool same = src_dtype == dst_dtype;
  if (!(same && DTypeBytes(src_dtype) != 0) &&
      !(IsFloatCode(src_dtype) && IsFloatCode(dst_dtype))) {
    return cudaErrorInvalidValue;
  }
  if (count == 0 || rows == 0) return cudaSuccess;
  const uint64_t size = DTypeBytes(src_dtype);
  if (same && src_stride == 1 && dst_stride == 1) {
    return Copy2D(dst, static_cast<uint64_t>(dst_row_stride) * size, src,
                  static_cast<uint64_t>(src_row_stride) * size, count * size, rows, stream);
  }
  RunGeometry g{count, count * rows, src_stride, dst_stride, src_row_stride, dst_row_stride, 0, 0,
                0};
  if (same) {
    switch (size) {
      case 1:
        return LaunchRun<uint8_t, uint8_t, 0, 0>(src, dst, g, stream);
      case 2:
        return LaunchRun<uint16_t, uint16_t, 0, 0>(src, dst, g, stream);
      case 4:
        return LaunchRun<uint32_t, uint32_t, 0, 0>(src, dst, g, stream);
      default:
        return LaunchRun<uint64_t, uint64_t, 0, 0>(src, dst, g, stream);
    }
  }
  switch (src_dtype) {
    case bits::kBF16:
      return LaunchConvertTo<bits::kBF16>(dst_dtype, src, dst, g, stream);
    case bits::kFP16:
      return LaunchConvertTo<bits::kFP16>(dst_dtype, src, dst, g, stream);
    case bits::kFP32:
      return LaunchConvertTo<bits::kFP32>(dst_dtype, src, dst, g, stream);
    case bits::kE4M3:
      return LaunchConvertTo<bits::kE4M3>(dst_dtype, src, dst, g, stream);
    default:
      return LaunchConvertTo<bits::kE5M2>(dst_dtype, src, dst, g, stream);
  }
}

cudaError_t Copy2D(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch,
                   uint64_t row_bytes, uint64_t rows, cudaStream_t stream) {
  if (row_bytes == 0 || rows == 0) return cudaSuccess;
  if (rows == 1) return cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyDefault, stream);
  cudaError_t status =
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, stream);
  if (status != cudaErrorInvalidPitchValue) return status;
  // Pitches the copy engines refuse (past cudaDevAttrMaxPitch): a byte-copy kernel, where both
  // sides are memory a kernel can reach (device, managed or pinned host memory).
  cudaGetLastError();  // the refusal above is not sticky; clear it
  for (const void* p : {static_cast<const void*>(dst), static_cast<const void*>(src)}) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess ||
        attributes.type == cudaMemoryTypeUnregistered) {
      cudaGetLastError();
      return status;
    }
  }
  RunGeometry g{row_bytes,
                row_bytes * rows,
                1,
                1,
                static_cast<int64_t>(src_pitch),
                static_cast<int64_t>(dst_pitch),
                0,
                0,
                0};
  return LaunchRun<uint8_t, uint8_t, 0, 0>(src, dst, g, stream);
}

cudaError_t ReadWriteReference(const uint8_t* a, const uint8_t* b, uint8_t* out, uint64_t bytes,
                               cudaStream_t stream) {
  if (bytes % kUnitBytes != 0 || !Aligned(a, kUnitBytes) || !Aligned(b, kUnitBytes) ||
      !Aligned(out, kUnitBytes)) {
    return cudaErrorInvalidValue;
  }
  const uint64_t n = bytes / kUnitBytes;
  const unsigned blocks = static_cast<unsigned>(std::min(CeilDiv(n, kThreads), kMaxBlocks * 4));
  ReadWriteKernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(a),
                                                   reinterpret_cast<const uint4*>(b),
                                                   reinterpret_cast<uint4*>(out), n);
  return LaunchError();
}

namespace {

// One block per run at a time (grid-stride over runs): the block's threads copy the run's bytes,
// in 8-byte words between its first and last aligned word where the destination and the values
// share their alignment, bytes around them (and throughout otherwise). Scatter (kGather false):
// `from` is the values, `to` the destination; gather: `from` the destination, `to` the values.
template <bool kGather>
__global__ void __launch_bounds__(kThreads)
    MoveRunsKernel(uint8_t* to_base, const ByteRun* runs, uint64_t n, const uint8_t* from_base) {
  for (uint64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const ByteRun run = runs[i];
    uint8_t* to = to_base + (kGather ? run.value_offset : run.dst_offset);
    const uint8_t* from = from_base + (kGather ? run.dst_offset : run.value_offset);
    uint64_t head = run.bytes;  // bytes copied one by one from the start
    uint64_t words = 0;
    const uintptr_t to_at = reinterpret_cast<uintptr_t>(to);
    if (((to_at ^ reinterpret_cast<uintptr_t>(from)) & 7) == 0) {
      const uint64_t to_word = (8 - (to_at & 7)) & 7;
      head = run.bytes < to_word ? run.bytes : to_word;
      words = (run.bytes - head) / 8;
    }
    for (uint64_t k = threadIdx.x; k < head; k += kThreads) to[k] = from[k];
    uint64_t* to_words = reinterpret_cast<uint64_t*>(to + head);
    const uint64_t* from_words = reinterpret_cast<const uint64_t*>(from + head);
    for (uint64_t k = threadIdx.x; k < words; k += kThreads) to_words[k] = from_words[k];
    for (uint64_t k = head + words * 8 + threadIdx.x; k < run.bytes; k += kThreads) {
      to[k] = from[k];
    }
  }
}

}  // namespace

cudaError_t ScatterRuns(uint8_t* dst, const ByteRun* runs, uint64_t n, const uint8_t* values,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min(n, kMaxBlocks));
  MoveRunsKernel<false><<<blocks, kThreads, 0, stream>>>(dst, runs, n, values);
  return LaunchError();
}

cudaError_t GatherRuns(uint8_t* values, const ByteRun* runs, uint64_t n, const uint8_t* src,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min(n, kMaxBlocks));
  MoveRunsKernel<true><<<blocks, kThreads, 0, stream>>>(values, runs, n, src);
  return LaunchError();
}

}  // namespace refit::cuda::gpu
