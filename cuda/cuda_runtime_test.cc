// The real cuda.h (--config=cuda) on a GPU: devices, IPC import of buffers another process
// exported (ipc_exporter), window and handle checks, slots, copies between every pair of memory
// kinds, and plans that reshard and convert between host and device regions, byte-compared
// with plan::ExecuteOnHost. Needs a GPU (tags: gpu).

#include <cuda_runtime_api.h>

#include <memory>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/cuda.h"
#include "cuda/gpu_testing.h"
#include "cuda/kernels_testing.h"
#include "daemon/plan/plan.h"

namespace refit::cuda {
namespace {

using testing::Bytes;

#define REQUIRE_GPU() REQUIRE(testing::HaveGpu())

std::string ExporterPath() {
  const std::string path = testing::FindExporter(nullptr);
  INFO("ipc_exporter not found in the runfiles");
  REQUIRE_FALSE(path.empty());
  return path;
}

// The bytes of any region, through cuda::Copy into host memory.
Bytes Read(const Region& region, uint64_t offset, uint64_t bytes) {
  auto host = AllocateHost(bytes);
  REQUIRE(host.ok());
  const absl::Status status = Copy(**host, 0, region, offset, bytes);
  INFO(status.ToString());
  REQUIRE(status.ok());
  return Bytes((*host)->data(), (*host)->data() + bytes);
}

void Write(const Region& region, uint64_t offset, const Bytes& bytes) {
  auto host = AllocateHost(bytes.size());
  REQUIRE(host.ok());
  std::copy(bytes.begin(), bytes.end(), (*host)->data());
  const absl::Status status = Copy(region, offset, **host, 0, bytes.size());
  INFO(status.ToString());
  REQUIRE(status.ok());
}

Bytes PatternBytes(uint64_t bytes, uint64_t seed, uint64_t from = 0) {
  Bytes out(bytes);
  for (uint64_t i = 0; i < bytes; ++i) out[i] = testing::Pattern(from + i, seed);
  return out;
}

TEST_CASE("CUDA is compiled in and sees the GPU", "[cuda]") {
  CHECK(CompiledIn());
  INFO(Describe());
  REQUIRE(DeviceCount() >= 1);
  CHECK(Describe().rfind("cuda: ", 0) == 0);
  CHECK(Describe().find(std::to_string(DeviceCount()) + " device(s)") != std::string::npos);
}

TEST_CASE("OpenIpc maps another process's buffer, both ways", "[cuda][ipc]") {
  REQUIRE_GPU();
  const uint64_t bytes = (uint64_t{8} << 20) + 4096;
  testing::Exporter exporter(ExporterPath(), bytes, 0, 2);

  auto whole = OpenIpc(exporter.handle(0), 0, 0, 0);  // size 0: to the end
  INFO(whole.status().ToString());
  REQUIRE(whole.ok());
  CHECK((*whole)->kind() == MemoryKind::kCuda);
  CHECK((*whole)->device() == 0);
  CHECK((*whole)->size() == bytes);
  CHECK((Read(**whole, 0, bytes) == PatternBytes(bytes, 1)));

  // A window, and a second import of the same handle sharing the mapping.
  auto window = OpenIpc(exporter.handle(0), 0, 4096, 1 << 20);
  REQUIRE(window.ok());
  CHECK((*window)->size() == uint64_t{1} << 20);
  CHECK((*window)->data() == (*whole)->data() + 4096);
  CHECK((Read(**window, 0, 1 << 20) == PatternBytes(1 << 20, 1, 4096)));
  whole->reset();  // the window keeps the mapping open
  CHECK((Read(**window, 100, 1000) == PatternBytes(1000, 1, 4196)));

  // Writes land in the exporter's memory.
  auto other = OpenIpc(exporter.handle(1), 0, 0, bytes);
  REQUIRE(other.ok());
  CHECK((Read(**other, 0, 4096) == PatternBytes(4096, 2)));
  Write(**other, 0, PatternBytes(bytes, 77));
  CHECK(exporter.Command("CHECK 1 77") == "OK");
  CHECK(exporter.Command("CHECK 0 1") == "OK");
}

TEST_CASE("OpenIpc refuses bad handles, devices and windows", "[cuda][ipc]") {
  REQUIRE_GPU();
  const uint64_t bytes = uint64_t{2} << 20;
  testing::Exporter exporter(ExporterPath(), bytes, 0, 2);
  const std::string& handle = exporter.handle(0);

  auto code = [](const absl::StatusOr<std::unique_ptr<Region>>& region) {
    UNSCOPED_INFO(region.status().ToString());
    return region.status().code();
  };
  CHECK(code(OpenIpc(handle.substr(0, 63), 0, 0, 0)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(handle + "x", 0, 0, 0)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(std::string(64, '\x5a'), 0, 0, 0)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(handle, DeviceCount(), 0, 0)) == absl::StatusCode::kFailedPrecondition);
  CHECK(code(OpenIpc(handle, -1, 0, 0)) == absl::StatusCode::kFailedPrecondition);
  // Windows past the allocation's real end.
  CHECK(code(OpenIpc(handle, 0, 0, bytes + 1)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(handle, 0, bytes, 0)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(handle, 0, bytes - 10, 11)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(OpenIpc(handle, 0, ~uint64_t{0}, 2)) == absl::StatusCode::kInvalidArgument);
  // Refusals leave no mapping behind: a good open still works, and sees the right bytes.
  auto last = OpenIpc(handle, 0, bytes - 10, 10);
  REQUIRE(last.ok());
  CHECK((Read(**last, 0, 10) == PatternBytes(10, 1, bytes - 10)));

  // A handle of this very process can't be imported here.
  auto own = AllocateDevice(1 << 20, 0);
  REQUIRE(own.ok());
  cudaIpcMemHandle_t own_handle;
  testing::CheckCuda(cudaIpcGetMemHandle(&own_handle, (*own)->data()), "cudaIpcGetMemHandle");
  CHECK(code(OpenIpc(std::string(reinterpret_cast<const char*>(&own_handle), 64), 0, 0, 0)) ==
        absl::StatusCode::kInvalidArgument);
  // A stale handle: the exporter freed the buffer.
  CHECK(exporter.Command("FREE 1") == "OK");
  CHECK(code(OpenIpc(exporter.handle(1), 0, 0, 0)) == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("slots: device and pinned allocations", "[cuda][alloc]") {
  REQUIRE_GPU();
  auto device = AllocateDevice(3 << 20, 0);
  REQUIRE(device.ok());
  CHECK((*device)->kind() == MemoryKind::kCuda);
  CHECK((*device)->size() == uint64_t{3} << 20);
  auto pinned = AllocatePinnedHost(3 << 20);
  REQUIRE(pinned.ok());
  CHECK((*pinned)->kind() == MemoryKind::kHost);
  cudaPointerAttributes attributes{};
  testing::CheckCuda(cudaPointerGetAttributes(&attributes, (*pinned)->data()), "attributes");
  CHECK(attributes.type == cudaMemoryTypeHost);
  CHECK(AllocateDevice(1, DeviceCount()).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(AllocateDevice(uint64_t{1} << 50, 0).status().code() ==
        absl::StatusCode::kResourceExhausted);
}

TEST_CASE("Copy moves bytes between every pair of memory kinds", "[cuda][copy]") {
  REQUIRE_GPU();
  // Past two 16 MiB staging chunks, at odd offsets.
  const uint64_t bytes = (uint64_t{40} << 20) + 123;
  const Bytes data = testing::RandomBytes(bytes, 5);
  std::vector<std::pair<std::string, std::unique_ptr<Region>>> regions;
  regions.emplace_back("pageable host", AllocateHost(bytes + 64).value());
  regions.emplace_back("pinned host", AllocatePinnedHost(bytes + 64).value());
  regions.emplace_back("device 0", AllocateDevice(bytes + 64, 0).value());
  if (DeviceCount() > 1) regions.emplace_back("device 1", AllocateDevice(bytes + 64, 1).value());
  for (auto& [src_name, src] : regions) {
    for (auto& [dst_name, dst] : regions) {
      if (src == dst) continue;
      INFO(src_name << " -> " << dst_name);
      Write(*src, 7, data);
      REQUIRE(Copy(*dst, 33, *src, 7, bytes).ok());
      REQUIRE((Read(*dst, 33, bytes) == data));
    }
  }
  CHECK(Copy(*regions[2].second, 65, *regions[0].second, 0, bytes).code() ==
        absl::StatusCode::kInvalidArgument);
}

// A TP2 -> TP1 reshard of two tensors with a conversion to `to`, column-split (strided rows) and
// row-split (contiguous), run with sources and destinations on host or device.
TEST_CASE("ExecutePlan reshards and converts like ExecuteOnHost, on any memory", "[cuda][plan]") {
  REQUIRE_GPU();
  const int64_t R = 512, C = 768;
  for (const DType to : {DType::kBF16, DType::kFP8E4M3, DType::kFP32}) {
    std::vector<std::vector<TensorSlice>> src(2), dst(1);
    auto slice = [](const char* name, DType dtype, std::vector<int64_t> shape,
                    std::vector<int64_t> offsets, std::vector<int64_t> sizes, uint64_t at) {
      TensorSlice s;
      s.name = name;
      s.dtype = dtype;
      s.global_shape = std::move(shape);
      s.offsets = std::move(offsets);
      s.sizes = std::move(sizes);
      s.buffer_offset = at;
      return s;
    };
    for (int64_t r = 0; r < 2; ++r) {
      src[r].push_back(slice("w", DType::kBF16, {R, C}, {0, r * C / 2}, {R, C / 2}, 0));
      src[r].push_back(slice("u", DType::kBF16, {C, R}, {r * C / 2, 0}, {C / 2, R}, R * C));
    }
    dst[0].push_back(slice("w", to, {R, C}, {}, {}, 0));
    dst[0].push_back(slice("u", to, {C, R}, {}, {}, R * C * DTypeSize(to)));
    const uint64_t src_bytes = 2 * R * C, dst_bytes = 2 * R * C * DTypeSize(to);
    for (auto& s : src) REQUIRE(plan::NormalizeAndValidateBuffer(s, src_bytes).ok());
    REQUIRE(plan::NormalizeAndValidateBuffer(dst[0], dst_bytes).ok());
    std::vector<plan::PlacedSlice> sources, destinations;
    for (uint32_t r = 0; r < 2; ++r) {
      for (const auto& s : src[r]) sources.push_back({&s, r, 0});
    }
    for (const auto& s : dst[0]) destinations.push_back({&s, 0, 0});
    plan::PlanOptions options;
    options.multi_row_ops = true;
    auto plan = plan::BuildPlan(sources, destinations, options);
    REQUIRE(plan.ok());

    const Bytes in0 = testing::RandomBytes(src_bytes, 1), in1 = testing::RandomBytes(src_bytes, 2);
    Bytes want(dst_bytes, 0);
    plan::ExecuteOnHost(*plan, {in0.data(), in1.data()}, {want.data()});
    for (const bool src_on_device : {false, true}) {
      for (const bool dst_on_device : {false, true}) {
        INFO("to " << DTypeName(to) << ", sources on " << (src_on_device ? "device" : "host")
                   << ", destination on " << (dst_on_device ? "device" : "host"));
        auto make = [](bool device, uint64_t size) {
          return device ? AllocateDevice(size, 0).value() : AllocateHost(size).value();
        };
        auto s0 = make(src_on_device, src_bytes), s1 = make(src_on_device, src_bytes);
        auto d = make(dst_on_device, dst_bytes);
        Write(*s0, 0, in0);
        Write(*s1, 0, in1);
        Write(*d, 0, Bytes(dst_bytes, 0));
        const absl::Status status = ExecutePlan(*plan, {s0.get(), s1.get()}, {d.get()});
        INFO(status.ToString());
        REQUIRE(status.ok());
        CHECK((Read(*d, 0, dst_bytes) == want));
      }
    }
  }
}

}  // namespace
}  // namespace refit::cuda
