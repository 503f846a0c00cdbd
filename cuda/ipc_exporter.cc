// A separate process that owns CUDA allocations and exports them with cudaIpcGetMemHandle, the
// way a trainer does: what cuda_runtime_test and gpu_bench import. (A handle can't be opened
// by the process that exported it, and CUDA doesn't survive fork(), hence a binary.)
//
//   ipc_exporter BYTES DEVICE COUNT
// allocates COUNT buffers of BYTES on DEVICE, fills buffer k with Pattern(i, k + 1) and prints
// "HANDLE k <128 hex digits>" for each. Then it answers commands, one line each:
//   CHECK k SEED  -> "OK" if buffer k holds Pattern(i, SEED) throughout, else "BAD <index>"
//   FREE k        -> frees buffer k (its handle goes stale) -> "OK"
// and exits at end of input, freeing everything.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/gpu_testing.h"

namespace {

using refit::cuda::testing::CheckCuda;
using refit::cuda::testing::Pattern;

std::vector<uint8_t> Filled(uint64_t bytes, uint64_t seed) {
  std::vector<uint8_t> host(bytes);
  for (uint64_t i = 0; i < bytes; ++i) host[i] = Pattern(i, seed);
  return host;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: ipc_exporter BYTES DEVICE COUNT\n");
    return 2;
  }
  const uint64_t bytes = std::strtoull(argv[1], nullptr, 10);
  const int device = std::atoi(argv[2]);
  const int count = std::atoi(argv[3]);
  CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  std::vector<void*> buffers(count, nullptr);
  for (int k = 0; k < count; ++k) {
    CheckCuda(cudaMalloc(&buffers[k], bytes), "cudaMalloc");
    const std::vector<uint8_t> host = Filled(bytes, k + 1);
    CheckCuda(cudaMemcpy(buffers[k], host.data(), bytes, cudaMemcpyHostToDevice), "fill");
    cudaIpcMemHandle_t handle;
    CheckCuda(cudaIpcGetMemHandle(&handle, buffers[k]), "cudaIpcGetMemHandle");
    std::printf("HANDLE %d ", k);
    const auto* raw = reinterpret_cast<const unsigned char*>(&handle);
    for (size_t i = 0; i < sizeof(handle); ++i) std::printf("%02x", raw[i]);
    std::printf("\n");
  }
  std::fflush(stdout);

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream words(line);
    std::string command;
    int k = -1;
    words >> command >> k;
    if (k < 0 || k >= count || buffers[k] == nullptr) {
      std::printf("ERROR bad buffer in '%s'\n", line.c_str());
    } else if (command == "CHECK") {
      uint64_t seed = 0;
      words >> seed;
      std::vector<uint8_t> host(bytes);
      CheckCuda(cudaMemcpy(host.data(), buffers[k], bytes, cudaMemcpyDeviceToHost), "check");
      uint64_t bad = bytes;
      for (uint64_t i = 0; i < bytes && bad == bytes; ++i) {
        if (host[i] != Pattern(i, seed)) bad = i;
      }
      if (bad == bytes) {
        std::printf("OK\n");
      } else {
        std::printf("BAD %llu\n", static_cast<unsigned long long>(bad));
      }
    } else if (command == "FREE") {
      CheckCuda(cudaFree(buffers[k]), "cudaFree");
      buffers[k] = nullptr;
      std::printf("OK\n");
    } else {
      std::printf("ERROR unknown command '%s'\n", line.c_str());
    }
    std::fflush(stdout);
  }
  for (void* buffer : buffers) {
    if (buffer != nullptr) cudaFree(buffer);
  }
  return 0;
}
