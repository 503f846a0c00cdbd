#include "tests/testing/real_model.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "nlohmann/json.hpp"
#include "tests/testing/shared_data.h"

namespace refit::testing {
namespace {

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

// Tensor-parallel split for the engine: -1 whole, 0 rows, 1 columns.
int Split(const Tensor& t) {
  if (t.shape.size() < 2) return -1;
  const bool row_parallel =
      t.name.find("o_proj") != std::string::npos || t.name.find("down_proj") != std::string::npos;
  return row_parallel ? 1 : 0;
}

}  // namespace

Data Load() {
  Data data;
  const std::string shared = FindSharedDir();
  if (shared.empty()) return data;
  const std::string dir = shared + "/data/deltas/tiny-llama-lr1e-6/";
  std::ifstream manifest(dir + "manifest.json");
  if (!manifest) return data;
  const nlohmann::json m = nlohmann::json::parse(manifest);
  for (const auto& t : m["tensors"]) {
    data.tensors.push_back({t["name"], t["shape"].get<std::vector<int64_t>>(), t["offset"]});
  }
  for (int v = 0; v < m["versions"].get<int>(); ++v) {
    data.versions.push_back(ReadAll(dir + "v00" + std::to_string(v) + ".bin"));
  }
  return data;
}

std::vector<v1::TensorSlice> SourceSlices(const Data& data) {
  std::vector<v1::TensorSlice> slices;
  for (const Tensor& t : data.tensors) {
    slices.push_back(client::Slice(t.name, v1::BF16, t.shape, t.offset));
  }
  return slices;
}

Engine MakeEngine(const Data& data) {
  Engine e;
  for (const Tensor& t : data.tensors) {
    std::vector<int64_t> offsets(t.shape.size(), 0), sizes = t.shape;
    const int split = Split(t);
    if (split >= 0) sizes[split] = t.shape[split] / 2;
    e.slices.push_back(client::Slice(t.name, v1::BF16, t.shape, e.bytes, offsets, sizes));
    const int64_t cols = t.shape.size() > 1 ? t.shape[1] : t.shape[0];
    const int64_t rows = t.shape.size() > 1 ? sizes[0] : 1;
    const int64_t take = t.shape.size() > 1 ? sizes[1] : sizes[0];
    for (int64_t r = 0; r < rows; ++r) {
      const uint64_t begin = t.offset + static_cast<uint64_t>(r * cols) * 2;
      e.source_runs.emplace_back(begin, begin + static_cast<uint64_t>(take) * 2);
      e.bytes += static_cast<uint64_t>(take) * 2;
    }
  }
  return e;
}

uint64_t CountWrongRuns(const Engine& engine, const uint8_t* dest,
                        const std::vector<uint8_t>& version) {
  uint64_t at = 0, wrong = 0;
  for (const auto& [b, e] : engine.source_runs) {
    if (std::memcmp(dest + at, version.data() + b, e - b) != 0) wrong++;
    at += e - b;
  }
  return wrong;
}

Ranges Merged(Ranges ranges) {
  std::sort(ranges.begin(), ranges.end());
  Ranges out;
  for (const auto& r : ranges) {
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

double Metric(client::Client& client, const std::string& name) {
  auto status = client.Status();
  if (!status.ok()) return -1;
  auto it = status->metrics().find(name);
  return it == status->metrics().end() ? 0 : it->second;
}

}  // namespace refit::testing
