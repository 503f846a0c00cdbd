// GPU UUIDs as they arrive in CudaIpc.device_uuid: the forms nvidia-smi, torch and the C++
// client write are read back to the same 16 bytes; anything else is INVALID_ARGUMENT.

#include "cuda/device_uuid.h"

#include "catch2/catch.hpp"

namespace refit::cuda {
namespace {

const GpuUuid kUuid = {0x6b, 0x1c, 0x9f, 0x2e, 0x0d, 0x3a, 0x4c, 0x7e,
                       0x9a, 0x51, 0x3f, 0x0e, 0x2d, 0x1c, 0x4b, 0x5a};

TEST_CASE("GPU UUIDs in nvidia-smi's, torch's and bare forms read the same", "[cuda][uuid]") {
  CHECK(FormatGpuUuid(kUuid) == "GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a");
  for (const char* text :
       {"GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a", "gpu-6B1C9F2E-0D3A-4C7E-9A51-3F0E2D1C4B5A",
        "6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a", "6b1c9f2e0d3a4c7e9a513f0e2d1c4b5a"}) {
    INFO(text);
    auto parsed = ParseGpuUuid(text);
    REQUIRE(parsed.ok());
    CHECK(*parsed == kUuid);
  }
  GpuUuid all{};
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i * 17 + 250);
  auto round_trip = ParseGpuUuid(FormatGpuUuid(all));
  REQUIRE(round_trip.ok());
  CHECK(*round_trip == all);
}

TEST_CASE("malformed GPU UUIDs are INVALID_ARGUMENT", "[cuda][uuid]") {
  for (const std::string& text :
       {std::string(""), std::string("GPU-"), std::string("0"),
        std::string("GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5"),    // a digit short
        std::string("GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a0"),  // a digit long
        std::string("GPU-6b1c9f2e-0d3a-4c7e-9a51_3f0e2d1c4b5a"),   // not a dash
        std::string("GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5g"),   // not hex
        std::string("MIG-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a"),   // a MIG instance
        std::string("6b1c9f2e-0d3a4c7e-9a51-3f0e2d1c4b5a-"),       // dashes misplaced
        std::string("6b1c9f2e0d3a4c7e9a513f0e2d1c4b5a\0", 33), std::string(5000, 'a')}) {
    INFO(text.substr(0, 80));
    auto parsed = ParseGpuUuid(text);
    REQUIRE_FALSE(parsed.ok());
    CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(parsed.status().message().size() < 300);
  }
}

}  // namespace
}  // namespace refit::cuda
