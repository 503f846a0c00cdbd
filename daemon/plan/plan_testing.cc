#include "daemon/plan/plan_testing.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace refit::plan::testing {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

uint64_t NameHash(const std::string& name) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
  return h;
}

// Raw bits of the source value for `dtype` (little-endian, DTypeSize bytes).
uint64_t SourceBits(const std::string& name, uint64_t index, DType dtype) {
  const uint64_t r = Mix(NameHash(name) ^ (index * 0x9e3779b97f4a7c15ULL));
  switch (dtype) {
    case DType::kBF16: {
      // sign, exponent in fp16's normal range [-14, 15], 7 fraction bits: exact in fp16/fp32.
      const uint64_t sign = (r >> 63) & 1;
      const uint64_t exp = 127 - 14 + (r >> 8) % 30;
      return (sign << 15) | (exp << 7) | (r & 0x7f);
    }
    case DType::kFP16: {
      const uint64_t sign = (r >> 63) & 1;
      const uint64_t exp = (r >> 16) % 31;  // no inf/NaN
      return (sign << 15) | (exp << 10) | (r & 0x3ff);
    }
    case DType::kFP32: {
      const uint64_t sign = (r >> 63) & 1;
      const uint64_t exp = 1 + (r >> 32) % 254;
      return (sign << 31) | (exp << 23) | (r & 0x7fffff);
    }
    default:
      return r;
  }
}

// Independent decoder for the float dtypes the helpers use.
double Decode(uint64_t bits, DType dtype) {
  int mant = 0;
  int exp_bits = 0;
  switch (dtype) {
    case DType::kBF16:
      mant = 7;
      exp_bits = 8;
      break;
    case DType::kFP16:
      mant = 10;
      exp_bits = 5;
      break;
    case DType::kFP32:
      mant = 23;
      exp_bits = 8;
      break;
    default:
      return static_cast<double>(bits);
  }
  const int bias = (1 << (exp_bits - 1)) - 1;
  const uint64_t frac = bits & ((uint64_t{1} << mant) - 1);
  const uint64_t exp = (bits >> mant) & ((uint64_t{1} << exp_bits) - 1);
  const bool negative = (bits >> (mant + exp_bits)) & 1;
  double value = exp == 0 ? std::ldexp(static_cast<double>(frac), 1 - bias - mant)
                          : std::ldexp(static_cast<double>(frac | (uint64_t{1} << mant)),
                                       static_cast<int>(exp) - bias - mant);
  return negative ? -value : value;
}

uint64_t Load(const uint8_t* p, size_t size) {
  uint64_t v = 0;
  std::memcpy(&v, p, size);
  return v;
}

// Calls fn(global flat index, byte offset in buffer) for every element of a normalized slice.
void ForEachElement(const TensorSlice& s, const std::function<void(uint64_t, uint64_t)>& fn) {
  const size_t rank = s.sizes.size();
  std::vector<int64_t> idx(rank, 0);
  const uint64_t elem = DTypeSize(s.dtype);
  for (uint64_t n = 0; n < s.NumElements(); ++n) {
    uint64_t global = 0;
    uint64_t offset = s.buffer_offset;
    for (size_t d = 0; d < rank; ++d) {
      global = global * s.global_shape[d] + (s.offsets[d] + idx[d]);
      offset += static_cast<uint64_t>(idx[d] * s.buffer_strides[d]) * elem;
    }
    fn(global, offset);
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < s.sizes[d]) break;
      idx[d] = 0;
    }
  }
}

DType Resolve(const TensorSpec& spec, DType dtype) {
  return dtype == DType::kUnspecified ? spec.dtype : dtype;
}

}  // namespace

TensorSlice Box(const TensorSpec& spec, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                DType dtype) {
  TensorSlice s;
  s.name = spec.name;
  s.dtype = Resolve(spec, dtype);
  s.global_shape = spec.shape;
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  return s;
}

TensorSlice Shard(const TensorSpec& spec, int dim, int parts, int rank, DType dtype) {
  const int64_t total = spec.shape[dim];
  const int64_t base = total / parts;
  const int64_t extra = total % parts;
  std::vector<int64_t> offsets(spec.shape.size(), 0);
  std::vector<int64_t> sizes = spec.shape;
  offsets[dim] = rank * base + std::min<int64_t>(rank, extra);
  sizes[dim] = base + (rank < extra ? 1 : 0);
  return Box(spec, offsets, sizes, dtype);
}

TensorSlice Whole(const TensorSpec& spec, DType dtype) {
  return Box(spec, std::vector<int64_t>(spec.shape.size(), 0), spec.shape, dtype);
}

void Append(Buffer& buffer, TensorSlice slice, uint64_t gap) {
  slice.buffer_offset = buffer.size + gap;
  slice.buffer_strides.clear();
  buffer.size = slice.buffer_offset + slice.NumElements() * DTypeSize(slice.dtype);
  buffer.slices.push_back(std::move(slice));
}

void AppendStrided(Buffer& buffer, TensorSlice slice, const std::vector<int>& order,
                   const std::vector<int64_t>& pad) {
  slice.buffer_strides.assign(slice.sizes.size(), 0);
  int64_t extent = 1;  // elements spanned by the dimensions placed so far
  for (size_t k = order.size(); k-- > 0;) {
    const int d = order[k];
    const int64_t stride = extent + pad[k];
    slice.buffer_strides[d] = stride;
    extent = (slice.sizes[d] - 1) * stride + extent;
  }
  slice.buffer_offset = buffer.size;
  buffer.size += extent * DTypeSize(slice.dtype);
  buffer.slices.push_back(std::move(slice));
}

void AppendColumnFused(Buffer& buffer, std::vector<TensorSlice> slices) {
  int64_t row = 0;
  for (const TensorSlice& s : slices) row += s.sizes[1];
  const uint64_t elem = DTypeSize(slices[0].dtype);
  int64_t column = 0;
  const uint64_t start = buffer.size;
  for (TensorSlice& s : slices) {
    s.buffer_offset = start + column * elem;
    s.buffer_strides = {row, 1};
    column += s.sizes[1];
    buffer.slices.push_back(s);
  }
  buffer.size = start + slices[0].sizes[0] * row * elem;
}

void Finish(std::vector<Buffer>& buffers) {
  for (Buffer& b : buffers) {
    const absl::Status status = NormalizeAndValidateBuffer(b.slices, b.size);
    if (!status.ok()) throw std::runtime_error("Finish: " + status.ToString());
    b.bytes.assign(b.size, 0);
  }
}

std::vector<PlacedSlice> Place(const std::vector<Buffer>& buffers) {
  std::vector<PlacedSlice> placed;
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (const TensorSlice& s : buffers[i].slices) {
      placed.push_back({&s, static_cast<uint32_t>(i), buffers[i].node});
    }
  }
  return placed;
}

double SourceValue(const std::string& name, uint64_t global_index, DType dtype) {
  return Decode(SourceBits(name, global_index, dtype), dtype);
}

void FillSources(std::vector<Buffer>& sources) {
  for (Buffer& b : sources) {
    for (const TensorSlice& s : b.slices) {
      const size_t elem = DTypeSize(s.dtype);
      ForEachElement(s, [&](uint64_t global, uint64_t offset) {
        const uint64_t bits = SourceBits(s.name, global, s.dtype);
        std::memcpy(b.bytes.data() + offset, &bits, elem);
      });
    }
  }
}

void ClearDestinations(std::vector<Buffer>& destinations) {
  for (Buffer& b : destinations) std::fill(b.bytes.begin(), b.bytes.end(), 0xEE);
}

uint64_t DestinationElements(const std::vector<Buffer>& destinations) {
  uint64_t n = 0;
  for (const Buffer& b : destinations) {
    for (const TensorSlice& s : b.slices) n += s.NumElements();
  }
  return n;
}

std::string ExecuteAndCheck(const Plan& plan, std::vector<Buffer>& sources,
                            std::vector<Buffer>& destinations) {
  std::ostringstream err;
  // Source dtype per tensor.
  std::map<std::string, DType> source_dtype;
  for (const Buffer& b : sources) {
    for (const TensorSlice& s : b.slices) source_dtype[s.name] = s.dtype;
  }
  // Count the bytes every op element writes, reading the op semantics from plan.h directly.
  std::vector<std::vector<uint32_t>> writes(destinations.size());
  for (size_t i = 0; i < destinations.size(); ++i) writes[i].assign(destinations[i].size, 0);
  uint64_t src_bytes = 0;
  uint64_t dst_bytes = 0;
  for (const CopyOp& op : plan.ops) {
    if (op.dst_location >= destinations.size() || op.src_location >= sources.size()) {
      return "op location out of range";
    }
    const uint64_t se = DTypeSize(op.src_dtype);
    const uint64_t de = DTypeSize(op.dst_dtype);
    src_bytes += op.rows * op.count * se;
    dst_bytes += op.rows * op.count * de;
    for (uint64_t r = 0; r < op.rows; ++r) {
      for (uint64_t i = 0; i < op.count; ++i) {
        const uint64_t s_at = op.src_offset + (r * op.src_row_stride + i * op.src_stride) * se;
        const uint64_t d_at = op.dst_offset + (r * op.dst_row_stride + i * op.dst_stride) * de;
        if (s_at + se > sources[op.src_location].size) return "op reads past its source";
        if (d_at + de > destinations[op.dst_location].size) return "op writes past its dest";
        for (uint64_t k = 0; k < de; ++k) ++writes[op.dst_location][d_at + k];
      }
    }
  }
  if (src_bytes != plan.src_bytes || dst_bytes != plan.dst_bytes) {
    err << "byte totals: ops say src " << src_bytes << " dst " << dst_bytes << ", plan says "
        << plan.src_bytes << " " << plan.dst_bytes;
    return err.str();
  }
  std::vector<const uint8_t*> src_ptrs;
  for (const Buffer& b : sources) src_ptrs.push_back(b.bytes.data());
  std::vector<uint8_t*> dst_ptrs;
  for (Buffer& b : destinations) dst_ptrs.push_back(b.bytes.data());
  ClearDestinations(destinations);
  ExecuteOnHost(plan, src_ptrs, dst_ptrs);
  uint64_t expected_dst_bytes = 0;
  for (size_t i = 0; i < destinations.size(); ++i) {
    const Buffer& b = destinations[i];
    for (const TensorSlice& s : b.slices) {
      const size_t elem = DTypeSize(s.dtype);
      const DType from = source_dtype.count(s.name) ? source_dtype[s.name] : s.dtype;
      std::string problem;
      ForEachElement(s, [&](uint64_t global, uint64_t offset) {
        expected_dst_bytes += elem;
        if (!problem.empty()) return;
        for (size_t k = 0; k < elem; ++k) {
          if (writes[i][offset + k] != 1) {
            problem = "tensor " + s.name + " element " + std::to_string(global) + " written " +
                      std::to_string(writes[i][offset + k]) + " times";
            return;
          }
          writes[i][offset + k] = 0;
        }
        const uint64_t got = Load(b.bytes.data() + offset, elem);
        bool ok;
        if (from == s.dtype) {
          ok = got == (SourceBits(s.name, global, from) &
                       (elem == 8 ? ~uint64_t{0} : ((uint64_t{1} << (8 * elem)) - 1)));
        } else {
          ok = Decode(got, s.dtype) == SourceValue(s.name, global, from);
        }
        if (!ok) {
          problem = "tensor " + s.name + " element " + std::to_string(global) + " has value " +
                    std::to_string(got);
        }
      });
      if (!problem.empty()) return problem;
    }
    for (uint64_t k = 0; k < writes[i].size(); ++k) {
      if (writes[i][k] != 0) {
        err << "destination " << i << " byte " << k << " written outside every slice";
        return err.str();
      }
    }
  }
  if (expected_dst_bytes != plan.dst_bytes) return "dst_bytes differs from the slices' bytes";
  return "";
}

}  // namespace refit::plan::testing
