#pragma once

// Helpers for the bucket tests: temporary directories, models of a few pieces whose versions
// change like real fine-tuning steps (random, or the real bf16 versions in
// shared/data/deltas when present), pieces for the Exporter with deltas made by
// daemon/delta, file edits (truncate, flip, remove) and host allocation. Test-only; not
// thread-safe.

#include <dirent.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/bucket/exporter.h"
#include "daemon/bucket/importer.h"
#include "daemon/bucket/temp_dir_testing.h"
#include "daemon/delta/delta.h"
#include "daemon/memory/region.h"
#include "nlohmann/json.hpp"
#include "tests/testing/shared_data.h"

namespace refit::bucket::testing {

using Bytes = std::vector<uint8_t>;

inline Allocator HostAllocator() {
  return [](uint64_t bytes) -> absl::StatusOr<std::shared_ptr<Region>> {
    auto region = AllocateHost(bytes);
    if (!region.ok()) return region.status();
    return std::shared_ptr<Region>(std::move(*region));
  };
}

inline std::optional<Bytes> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline void Truncate(const std::string& path, uint64_t keep) {
  REQUIRE(truncate(path.c_str(), static_cast<off_t>(keep)) == 0);
}

inline void FlipByte(const std::string& path, uint64_t at, uint8_t mask = 0x10) {
  auto bytes = ReadFile(path);
  REQUIRE(bytes.has_value());
  REQUIRE(at < bytes->size());
  (*bytes)[at] ^= mask;
  WriteFile(path, *bytes);
}

inline bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// The names of the plain files in `dir`, sorted (hidden ones included).
inline std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> names;
  DIR* handle = opendir(dir.c_str());
  REQUIRE(handle != nullptr);
  while (struct dirent* entry = readdir(handle)) {
    if (entry->d_type == DT_REG) names.push_back(entry->d_name);
  }
  closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

// One SOURCE buffer of a test model: its layout and its bytes in each version (index 0 is
// version 1).
struct TestBuffer {
  std::string id;
  std::vector<TensorSlice> layout;
  std::vector<Bytes> versions;
};

struct TestModel {
  std::string name;
  std::vector<TestBuffer> buffers;
  size_t num_versions() const { return buffers.empty() ? 0 : buffers[0].versions.size(); }
};

inline TensorSlice Slice(const std::string& name, DType dtype, std::vector<int64_t> shape,
                         uint64_t buffer_offset) {
  TensorSlice slice;
  slice.name = name;
  slice.dtype = dtype;
  slice.global_shape = std::move(shape);
  slice.buffer_offset = buffer_offset;
  return slice;
}

// Changes each element (of `element` bytes) with probability `density` by +-1 in its bit
// pattern, like a bf16 fine-tuning step.
inline Bytes Step(const Bytes& base, size_t element, double density, std::mt19937_64& rng) {
  Bytes next = base;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (size_t i = 0; i + element <= next.size(); i += element) {
    if (unit(rng) >= density) continue;
    next[i] = static_cast<uint8_t>(next[i] + ((rng() & 1) ? 1 : -1));
    if (next[i] == base[i]) next[i] ^= 1;
  }
  return next;
}

// Three buffers (bf16, fp32 + int8, bf16) of a few hundred KiB, `versions` versions.
inline TestModel RandomModel(const std::string& name, size_t versions, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TestModel model{name, {}};
  model.buffers.push_back(
      {"node-a/0",
       {Slice("w.q", DType::kBF16, {256, 256}, 0), Slice("w.k", DType::kBF16, {128, 256}, 131072)},
       {}});
  model.buffers.push_back(
      {"node-a/1",
       {Slice("norm", DType::kFP32, {4096}, 0), Slice("idx", DType::kINT8, {1000}, 16384)},
       {}});
  model.buffers.push_back({"node-a/2", {Slice("mlp", DType::kBF16, {300, 500}, 0)}, {}});
  const uint64_t sizes[3] = {196608, 17384, 300000};
  const size_t elements[3] = {2, 4, 2};
  for (size_t b = 0; b < 3; ++b) {
    Bytes bytes(sizes[b]);
    for (auto& byte : bytes) byte = static_cast<uint8_t>(rng());
    model.buffers[b].versions.push_back(bytes);
    for (size_t v = 1; v < versions; ++v) {
      model.buffers[b].versions.push_back(
          Step(model.buffers[b].versions.back(), elements[b], 0.01, rng));
    }
  }
  return model;
}

using ::refit::testing::FindSharedDir;

// The real bf16 versions v000..v003 of shared/data/deltas/<folder>, split into two buffers
// (the first `split` tensors and the rest), as versions 1..4. nullopt (with a WARN) when the
// shared directory is absent and REFIT_SHARED_DIR unset (SharedDirOrSkip); a test failure when
// it is present but damaged, or REFIT_SHARED_DIR names a directory without the data.
inline std::optional<TestModel> RealModel(const std::string& folder, size_t split = 20) {
  const std::string shared = ::refit::testing::SharedDirOrSkip("the real-data bucket checks");
  if (shared.empty()) return std::nullopt;
  const std::string root = shared + "/data/deltas/" + folder;
  auto text = ReadFile(root + "/manifest.json");
  REQUIRE(text.has_value());
  const auto json = nlohmann::json::parse(text->begin(), text->end());
  const auto& tensors = json.at("tensors");
  REQUIRE(tensors.size() > split);
  TestModel model{"tiny-llama/" + folder, {{"trainer/0", {}, {}}, {"trainer/1", {}, {}}}};
  const uint64_t cut = tensors[split].at("offset").get<uint64_t>();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t offset = tensors[t].at("offset").get<uint64_t>();
    TestBuffer& buffer = model.buffers[t < split ? 0 : 1];
    buffer.layout.push_back(Slice(tensors[t].at("name").get<std::string>(), DType::kBF16,
                                  tensors[t].at("shape").get<std::vector<int64_t>>(),
                                  t < split ? offset : offset - cut));
  }
  for (int v = 0; v < 4; ++v) {
    auto bytes = ReadFile(root + "/v00" + std::to_string(v) + ".bin");
    INFO(root);
    REQUIRE(bytes.has_value());
    REQUIRE(bytes->size() == 6066688);
    model.buffers[0].versions.emplace_back(bytes->begin(), bytes->begin() + cut);
    model.buffers[1].versions.emplace_back(bytes->begin() + cut, bytes->end());
  }
  return model;
}

// Deltas from version `version - 1` to `version` of every buffer (empty for version 1).
inline std::vector<Bytes> EncodeDeltas(const TestModel& model, size_t version) {
  std::vector<Bytes> deltas(model.buffers.size());
  if (version < 2) return deltas;
  for (size_t b = 0; b < model.buffers.size(); ++b) {
    const Bytes& base = model.buffers[b].versions[version - 2];
    const Bytes& target = model.buffers[b].versions[version - 1];
    bool bf16 = true;
    for (const TensorSlice& slice : model.buffers[b].layout) bf16 &= slice.dtype == DType::kBF16;
    auto delta =
        delta::Encode(base.data(), target.data(), base.size(), bf16 ? DType::kBF16 : DType::kUINT8);
    REQUIRE(delta.ok());
    deltas[b] = std::move(*delta);
  }
  return deltas;
}

// The Exporter's pieces for `version` (1-based), with `deltas` (from EncodeDeltas) attached.
inline std::vector<ExportPiece> Pieces(const TestModel& model, size_t version,
                                       const std::vector<Bytes>& deltas) {
  std::vector<ExportPiece> pieces;
  for (size_t b = 0; b < model.buffers.size(); ++b) {
    const TestBuffer& buffer = model.buffers[b];
    ExportPiece piece;
    piece.buffer_id = buffer.id;
    piece.layout = buffer.layout;
    piece.bytes = buffer.versions[version - 1].size();
    piece.data = buffer.versions[version - 1].data();
    if (b < deltas.size() && !deltas[b].empty()) {
      piece.delta = deltas[b].data();
      piece.delta_size = deltas[b].size();
      piece.delta_base = version - 1;
    }
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

// Exports versions [first, last] of `model` with deltas; REQUIREs success.
inline void ExportVersions(Exporter& exporter, const TestModel& model, size_t first, size_t last) {
  for (size_t v = first; v <= last; ++v) {
    const auto deltas = EncodeDeltas(model, v);
    auto result = exporter.Write(model.name, v, Pieces(model, v, deltas));
    INFO("version " << v << ": " << result.status().ToString());
    REQUIRE(result.ok());
  }
}

// True when `imported` holds exactly version `version` (1-based) of `model`.
inline bool SameBytes(const ImportedVersion& imported, const TestModel& model, size_t version) {
  if (imported.version != version || imported.pieces.size() != model.buffers.size()) {
    return false;
  }
  for (size_t b = 0; b < model.buffers.size(); ++b) {
    const Bytes& expected = model.buffers[b].versions[version - 1];
    const ImportedPiece& piece = imported.pieces[b];
    if (piece.buffer_id != model.buffers[b].id || piece.bytes != expected.size() ||
        std::memcmp(piece.region->data(), expected.data(), expected.size()) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace refit::bucket::testing
