#pragma once

// Test helpers for plans: build buffers of slices (sharded, fused, strided), fill source buffers
// with values derived from each element's global index, and check an executed plan against an
// independent reading of the layouts. Test-only; not thread-safe.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "daemon/common/types.h"
#include "daemon/plan/plan.h"

namespace refit::plan::testing {

struct TensorSpec {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
};

// One location: its slices (normalized once `Finish`ed), its node and its bytes.
struct Buffer {
  std::vector<TensorSlice> slices;
  uint64_t size = 0;
  uint32_t node = 0;
  std::vector<uint8_t> bytes;
};

// The box [offsets, offsets + sizes) of `spec` with `dtype` (kUnspecified: the spec's).
TensorSlice Box(const TensorSpec& spec, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                DType dtype = DType::kUnspecified);
// Piece `rank` of `parts` along `dim`; uneven sizes give the first pieces one element more.
TensorSlice Shard(const TensorSpec& spec, int dim, int parts, int rank,
                  DType dtype = DType::kUnspecified);
TensorSlice Whole(const TensorSpec& spec, DType dtype = DType::kUnspecified);

// Appends `slice` row-major contiguous after the buffer's last byte, `gap` bytes later.
void Append(Buffer& buffer, TensorSlice slice, uint64_t gap = 0);
// Appends `slice` with its dimensions laid out in `order` (outermost first) and `pad[k]` extra
// elements of stride on order[k] (the innermost dimension's pad becomes its stride - 1).
void AppendStrided(Buffer& buffer, TensorSlice slice, const std::vector<int>& order,
                   const std::vector<int64_t>& pad);
// Appends 2-D slices column-concatenated: row i of slices[j] sits after row i of slices[j - 1].
// All must have the same dtype and row count.
void AppendColumnFused(Buffer& buffer, std::vector<TensorSlice> slices);

// Normalizes and validates every buffer (REQUIREs OK) and allocates its bytes.
void Finish(std::vector<Buffer>& buffers);

// Locations are indices into `buffers`.
std::vector<PlacedSlice> Place(const std::vector<Buffer>& buffers);

// Writes every source element's value: a pseudo-random pattern keyed by tensor name and global
// index, chosen so that bf16 values are exact in fp16 and fp32 (no NaN, no inf).
void FillSources(std::vector<Buffer>& sources);
// Fills destination bytes with 0xEE so that unwritten elements show.
void ClearDestinations(std::vector<Buffer>& destinations);

// Runs `plan` with ExecuteOnHost and checks, independently of the planner: every destination
// element holds its source element's value (converted), every destination element's bytes were
// written by exactly one op element and nothing else was written, and src/dst byte totals.
// Returns "" or a description of the first problem.
std::string ExecuteAndCheck(const Plan& plan, std::vector<Buffer>& sources,
                            std::vector<Buffer>& destinations);

// The value the test expects at `global_index` of tensor `name` stored as `dtype`, as a double
// (for float dtypes) or as the raw integer (for integer dtypes).
double SourceValue(const std::string& name, uint64_t global_index, DType dtype);

// Total bytes of source-dtype elements over every destination slice.
uint64_t DestinationElements(const std::vector<Buffer>& destinations);

}  // namespace refit::plan::testing
