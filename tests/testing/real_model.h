#pragma once

// The real successive bf16 versions of a trained model in ../shared/data/deltas
// (tiny-llama-lr1e-6: v000..v003, 49 tensors named like Hugging Face Llama), as the
// integration tests use them: the trainer holds the model as one SOURCE buffer laid out as on
// disk; an engine holds tensor-parallel rank 0 of 2 (q/k/v/gate/up/embed split on rows, o/down
// on columns, norms whole), so what it needs is part of the source buffer.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "client/refit_client.h"

namespace refit::testing {

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // bytes, in the source buffer
};

struct Data {
  std::vector<Tensor> tensors;
  std::vector<std::vector<uint8_t>> versions;  // v000 .. v003
};

// Loads tiny-llama-lr1e-6 from the shared data directory (FindSharedDir, shared_data.h); empty
// when missing.
Data Load();

// SOURCE slices of the whole model, tensors at their file offsets.
std::vector<v1::TensorSlice> SourceSlices(const Data& data);

// Engine rank 0 of 2: its slices, and the source byte runs its elements come from, in the
// order they sit in its buffer (the reference to check against).
struct Engine {
  std::vector<v1::TensorSlice> slices;
  Ranges source_runs;
  uint64_t bytes = 0;
};
Engine MakeEngine(const Data& data);

// Number of runs of `engine.source_runs` whose bytes in `dest` differ from `version`'s.
uint64_t CountWrongRuns(const Engine& engine, const uint8_t* dest,
                        const std::vector<uint8_t>& version);

// Sorted, with overlapping or touching ranges merged.
Ranges Merged(Ranges ranges);

// A counter from the daemon's Status (0 when absent).
double Metric(client::Client& client, const std::string& name);

}  // namespace refit::testing
