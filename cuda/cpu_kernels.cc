// The CPU kernels: the reference for the GPU ones, and what runs on host memory.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/float_bits.h"
#include "cuda/kernels.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/dtype_convert.h"

namespace refit::cuda {

// float_bits.h numbers the float dtypes itself, so that nvcc needs nothing from daemon/.
static_assert(static_cast<int>(DType::kBF16) == bits::kBF16);
static_assert(static_cast<int>(DType::kFP16) == bits::kFP16);
static_assert(static_cast<int>(DType::kFP32) == bits::kFP32);
static_assert(static_cast<int>(DType::kFP8E4M3) == bits::kE4M3);
static_assert(static_cast<int>(DType::kFP8E5M2) == bits::kE5M2);

bool IsKernelElementSize(uint64_t element_size) {
  return element_size == 1 || element_size == 2 || element_size == 4 || element_size == 8;
}

namespace cpu {
namespace {

absl::Status CheckElementSize(uint64_t element_size) {
  if (IsKernelElementSize(element_size)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("element size ", element_size, " is not 1, 2, 4 or 8 bytes"));
}

template <typename T>
T Load(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

template <typename T>
void Store(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

// Calls fn.template operator()<T>() with the unsigned integer type of `element_size` bytes.
template <typename Fn>
void WithElementType(uint64_t element_size, Fn&& fn) {
  switch (element_size) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      return fn(uint64_t{});
  }
}

template <typename T>
uint64_t FindChangesTyped(const uint8_t* base, const uint8_t* target, uint64_t n,
                          uint64_t* positions, uint64_t capacity) {
  // Weights change sparsely: skip equal 64-byte blocks with one memcmp (vectorized by libc) and
  // look at single elements only inside blocks that differ.
  constexpr uint64_t kBlock = 64 / sizeof(T);
  uint64_t found = 0;
  auto scan = [&](uint64_t first, uint64_t last) {
    for (uint64_t i = first; i < last; ++i) {
      if (Load<T>(base + i * sizeof(T)) != Load<T>(target + i * sizeof(T))) {
        if (found < capacity) positions[found] = i;
        ++found;
      }
    }
  };
  uint64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (std::memcmp(base + i * sizeof(T), target + i * sizeof(T), 64) != 0) scan(i, i + kBlock);
  }
  scan(i, n);
  return found;
}

}  // namespace

absl::StatusOr<uint64_t> FindChanges(const uint8_t* base, const uint8_t* target,
                                     uint64_t num_elements, uint64_t element_size,
                                     uint64_t* positions, uint64_t capacity) {
  RETURN_IF_ERROR(CheckElementSize(element_size));
  uint64_t found = 0;
  WithElementType(element_size, [&](auto type) {
    found = FindChangesTyped<decltype(type)>(base, target, num_elements, positions, capacity);
  });
  return found;
}

absl::Status GatherValues(const uint8_t* src, uint64_t element_size, const uint64_t* positions,
                          uint64_t n, uint8_t* values) {
  RETURN_IF_ERROR(CheckElementSize(element_size));
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(values + i * element_size, src + positions[i] * element_size, element_size);
  }
  return absl::OkStatus();
}

absl::Status ScatterValues(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                           const uint8_t* values, uint64_t n) {
  RETURN_IF_ERROR(CheckElementSize(element_size));
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(dst + positions[i] * element_size, values + i * element_size, element_size);
  }
  return absl::OkStatus();
}

absl::Status GatherDiffs(const uint8_t* base, const uint8_t* target, uint64_t element_size,
                         const uint64_t* positions, uint64_t n, uint8_t* diffs) {
  RETURN_IF_ERROR(CheckElementSize(element_size));
  WithElementType(element_size, [&](auto type) {
    using T = decltype(type);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = positions[i] * sizeof(T);
      Store<T>(diffs + i * sizeof(T), static_cast<T>(Load<T>(target + at) - Load<T>(base + at)));
    }
  });
  return absl::OkStatus();
}

absl::Status ScatterAddDiffs(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                             const uint8_t* diffs, uint64_t n) {
  RETURN_IF_ERROR(CheckElementSize(element_size));
  WithElementType(element_size, [&](auto type) {
    using T = decltype(type);
    for (uint64_t i = 0; i < n; ++i) {
      uint8_t* at = dst + positions[i] * sizeof(T);
      Store<T>(at, static_cast<T>(Load<T>(at) + Load<T>(diffs + i * sizeof(T))));
    }
  });
  return absl::OkStatus();
}

absl::Status Convert(const uint8_t* src, DType src_dtype, uint8_t* dst, DType dst_dtype,
                     const ElementRun& run) {
  RETURN_IF_ERROR(plan::CheckConvertible(src_dtype, dst_dtype));
  const int64_t src_row_step = run.src_row_stride * static_cast<int64_t>(DTypeSize(src_dtype));
  const int64_t dst_row_step = run.dst_row_stride * static_cast<int64_t>(DTypeSize(dst_dtype));
  for (uint64_t r = 0; r < run.rows; ++r) {
    const int64_t row = static_cast<int64_t>(r);
    plan::ConvertRun(src + row * src_row_step, src_dtype, run.src_stride, dst + row * dst_row_step,
                     dst_dtype, run.dst_stride, run.count);
  }
  return absl::OkStatus();
}

void Copy2D(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch,
            uint64_t row_bytes, uint64_t rows) {
  for (uint64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_pitch, src + r * src_pitch, row_bytes);
  }
}

void ScatterRuns(uint8_t* dst, const ByteRun* runs, uint64_t n, const uint8_t* values) {
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(dst + runs[i].dst_offset, values + runs[i].value_offset, runs[i].bytes);
  }
}

void GatherRuns(uint8_t* values, const ByteRun* runs, uint64_t n, const uint8_t* src) {
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(values + runs[i].value_offset, src + runs[i].dst_offset, runs[i].bytes);
  }
}

}  // namespace cpu
}  // namespace refit::cuda
