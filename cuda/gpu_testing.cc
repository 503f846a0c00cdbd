#include "cuda/gpu_testing.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace refit::cuda::testing {
namespace {

bool Exists(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

int FromHex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "gpu_testing: %s\n", message.c_str());
  std::abort();
}

}  // namespace

void CheckCuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  Die(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

bool HaveGpu() {
  static const bool have = [] {
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || count == 0) {
      std::fprintf(stderr, "no usable CUDA device: %s\n",
                   error != cudaSuccess ? cudaGetErrorName(error) : "0 devices");
      return false;
    }
    return true;
  }();
  return have;
}

DeviceBuffer::DeviceBuffer(uint64_t bytes) : size_(bytes) {
  void* data = nullptr;
  CheckCuda(cudaMalloc(&data, bytes == 0 ? 1 : bytes), "cudaMalloc");
  data_ = static_cast<uint8_t*>(data);
}

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

void DeviceBuffer::Upload(const void* host, uint64_t bytes, uint64_t offset) {
  CheckCuda(cudaMemcpy(data_ + offset, host, bytes, cudaMemcpyHostToDevice), "upload");
}

std::vector<uint8_t> DeviceBuffer::Download(uint64_t bytes, uint64_t offset) const {
  std::vector<uint8_t> host(bytes);
  CheckCuda(cudaMemcpy(host.data(), data_ + offset, bytes, cudaMemcpyDeviceToHost), "download");
  return host;
}

Exporter::Exporter(const std::string& path, uint64_t bytes, int device, int count) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) Die("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) {
    posix_spawn_file_actions_addclose(&actions, fd);
  }
  const std::string bytes_arg = std::to_string(bytes), device_arg = std::to_string(device),
                    count_arg = std::to_string(count);
  char* argv[] = {const_cast<char*>(path.c_str()), const_cast<char*>(bytes_arg.c_str()),
                  const_cast<char*>(device_arg.c_str()), const_cast<char*>(count_arg.c_str()),
                  nullptr};
  if (posix_spawn(&pid_, path.c_str(), &actions, nullptr, argv, environ) != 0) {
    Die(absl::StrCat("cannot start ", path));
  }
  posix_spawn_file_actions_destroy(&actions);
  close(to_child[0]);
  close(from_child[1]);
  to_child_ = to_child[1];
  from_child_ = fdopen(from_child[0], "r");
  for (int k = 0; k < count; ++k) {
    const std::string line = Command("");  // just reads: the exporter speaks first
    // "HANDLE <k> <128 hex digits>"
    const size_t space = line.rfind(' ');
    if (line.rfind("HANDLE ", 0) != 0 || space == std::string::npos ||
        line.size() - space - 1 != 2 * sizeof(cudaIpcMemHandle_t)) {
      Die(absl::StrCat("ipc_exporter said '", line, "'"));
    }
    std::string handle;
    for (size_t i = space + 1; i + 1 < line.size(); i += 2) {
      handle.push_back(static_cast<char>(FromHex(line[i]) * 16 + FromHex(line[i + 1])));
    }
    handles_.push_back(handle);
  }
}

Exporter::~Exporter() {
  if (to_child_ >= 0) close(to_child_);  // EOF: the exporter frees its memory and exits
  if (from_child_ != nullptr) std::fclose(from_child_);
  if (pid_ > 0) {
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

std::string Exporter::Command(const std::string& line) {
  if (!line.empty()) {
    const std::string out = line + "\n";
    if (write(to_child_, out.data(), out.size()) != static_cast<ssize_t>(out.size())) {
      Die("cannot write to ipc_exporter");
    }
  }
  char buffer[512];
  if (std::fgets(buffer, sizeof(buffer), from_child_) == nullptr) {
    Die("ipc_exporter exited early");
  }
  std::string reply = buffer;
  while (!reply.empty() && (reply.back() == '\n' || reply.back() == '\r')) reply.pop_back();
  return reply;
}

std::string FindExporter(const char* argv0) {
  if (Exists("cuda/ipc_exporter")) return "cuda/ipc_exporter";  // runfiles (bazel test)
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
    const std::string path = absl::StrCat(srcdir, "/refit/cuda/ipc_exporter");
    if (Exists(path)) return path;
  }
  if (argv0 == nullptr) return "";
  const std::string self = argv0;
  const std::string dir =
      self.find('/') == std::string::npos ? "." : self.substr(0, self.rfind('/'));
  for (const std::string& candidate :
       {dir + "/ipc_exporter", self + ".runfiles/refit/cuda/ipc_exporter"}) {
    if (Exists(candidate)) return candidate;
  }
  return "";
}

}  // namespace refit::cuda::testing
