// The run-list sparse Apply into GPU DESTINATION buffers (needs a GPU, --config=cuda, tags gpu
// + manual: the GPU bundle runs it, CI does not): a GPU destination and a host destination of
// the same layouts (a row shard with fp32 -> bf16, a fused buffer with a row stride, a
// column-major one with fp32 -> fp16) take the same delta versions from host slots; every
// sparse Apply into the GPU ones goes through the CUDA RunWriter (gpu::ScatterRuns and
// gpu::GatherRuns) and leaves them bit for bit what the host ones hold after the host sparse
// Apply, with the same bytes written. Without a GPU every case fails on its first line.

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/cuda.h"
#include "cuda/gpu_testing.h"
#include "daemon/store/sparse_testing.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

using namespace sparse_testing;  // NOLINT: the shared layouts and helpers

std::vector<uint8_t> Read(const Region& region) {
  auto host = AllocateHost(region.size());
  REQUIRE(host.ok());
  REQUIRE(cuda::Copy(**host, 0, region, 0, region.size()).ok());
  return std::vector<uint8_t>((*host)->data(), (*host)->data() + region.size());
}

TEST_CASE("a sparse Apply into GPU destinations is bit for bit the host destinations'",
          "[gpu][store][sparse]") {
  REQUIRE(cuda::testing::HaveGpu());
  Metrics metrics;
  StoreOptions o;
  o.retain = 2;
  o.node = "n";
  o.sparse_bytes_per_run = 0;
  o.gpu_sparse_bytes_per_run = 0;
  Store store(o, &metrics);
  Host src(kW + kF + kQ);
  Randomize(src.data, src.size, 1);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  REQUIRE(src_id.ok());
  const std::vector<std::vector<TensorSlice>> layouts = {Dest1(), Dest2(), Dest3()};
  const std::vector<uint64_t> sizes = {kD1, kD2, kD3};
  std::vector<std::string> gpu_ids, host_ids;
  std::vector<const Region*> gpu_regions;
  std::vector<uint8_t*> host_data;
  for (size_t k = 0; k < layouts.size(); ++k) {
    auto g = cuda::AllocateDevice(sizes[k], 0);
    REQUIRE(g.ok());
    Host fill(sizes[k]);
    std::memset(fill.data, 0x33, sizes[k]);  // the fused buffer's other tensor: never written
    REQUIRE(cuda::Copy(**g, 0, *fill.owned, 0, sizes[k]).ok());
    gpu_regions.push_back(g->get());
    auto gid = store.RegisterBuffer("m", Role::kDestination, std::move(g).value(), layouts[k], "g");
    Host h(sizes[k]);
    std::memset(h.data, 0x33, sizes[k]);
    host_data.push_back(h.data);
    auto hid = store.RegisterBuffer("m", Role::kDestination, std::move(h.owned), layouts[k], "h");
    REQUIRE(gid.ok());
    REQUIRE(hid.ok());
    gpu_ids.push_back(*gid);
    host_ids.push_back(*hid);
  }
  const std::vector<double> shares = {1, 0.004, 0.01, 0, 0.05, 0.004};
  for (size_t v = 0; v < shares.size(); ++v) {
    const uint64_t version = v + 1;
    INFO("version " << version);
    if (shares[v] >= 1) {
      Randomize(src.data, src.size, 100);
    } else {
      Step(src.data, src.size, shares[v], static_cast<uint32_t>(version));
    }
    REQUIRE(store.Publish("m", version, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", version, Clock::now() + milliseconds(5000), nullptr).ok());
    auto on_gpu = store.Apply("m", version, gpu_ids);
    INFO(on_gpu.status().ToString());
    REQUIRE(on_gpu.ok());
    auto on_host = store.Apply("m", version, host_ids);
    REQUIRE(on_host.ok());
    CHECK(on_gpu->sparse == (version > 1));
    CHECK(on_host->sparse == (version > 1));
    CHECK(on_gpu->bytes_written == on_host->bytes_written);
    for (size_t k = 0; k < layouts.size(); ++k) {
      INFO("destination " << k);
      const std::vector<uint8_t> got = Read(*gpu_regions[k]);
      CHECK(std::memcmp(got.data(), host_data[k], sizes[k]) == 0);
    }
  }
  CHECK(metrics.Get("refit_apply_sparse_total") == 2 * (shares.size() - 1));
}

}  // namespace
}  // namespace refit
