#pragma once

// Helpers for the GPU tests and gpu_bench (--config=cuda only): device buffers, and a spawned
// ipc_exporter process holding CUDA allocations to import. A CUDA error while setting up is a
// broken machine, not a test result: these helpers print it and abort. Not thread-safe.

#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace refit::cuda::testing {

// Prints "what: error" and aborts unless `error` is cudaSuccess.
void CheckCuda(cudaError_t error, const char* what);

// True when a CUDA device is usable; otherwise prints why (once) to stderr.
bool HaveGpu();

// The bytes ipc_exporter fills its allocations with, and tests write through imported regions:
// byte i of a buffer under `seed`.
inline uint8_t Pattern(uint64_t i, uint64_t seed) {
  return static_cast<uint8_t>(i * (2 * seed + 1) + seed + (i >> 11));
}

// cudaMalloc'ed memory on the current device, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uint8_t* get() const { return data_; }
  uint64_t size() const { return size_; }
  void Upload(const void* host, uint64_t bytes, uint64_t offset = 0);
  std::vector<uint8_t> Download(uint64_t bytes, uint64_t offset = 0) const;

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// A running ipc_exporter (ipc_exporter.cc has the protocol): `count` allocations of `bytes` on
// `device`, each filled with Pattern(i, k + 1) for buffer k, their handles read back.
class Exporter {
 public:
  // Spawns `path`; aborts if it does not come up.
  Exporter(const std::string& path, uint64_t bytes, int device, int count);
  ~Exporter();  // asks it to exit and reaps it
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  // The raw 64-byte cudaIpcMemHandle_t of buffer k.
  const std::string& handle(int k) const { return handles_[k]; }
  // Sends one command line and returns the reply line.
  std::string Command(const std::string& line);

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  FILE* from_child_ = nullptr;
  std::vector<std::string> handles_;
};

// Where the ipc_exporter binary is: in the runfiles under `bazel test`, next to `argv0` under
// `bazel run` or when run from bazel-bin.
std::string FindExporter(const char* argv0);

}  // namespace refit::cuda::testing
