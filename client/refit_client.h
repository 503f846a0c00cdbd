#pragma once

// The C++ client library for refit: what trainer ranks, inference engines, refitctl, the demo
// and the integration tests use to talk to their node's refitd over its Unix socket.
//
//   auto shm = SharedMemory::Create("/trainer-rank0", bytes);      // the weights live here
//   auto client = Client::Connect();                               // $REFIT_SOCKET or default
//   auto id = client->RegisterBuffer("llama", v1::SOURCE, *shm, {Slice("w", v1::BF16, {4096})});
//   client->Publish("llama", 1, {*id});                             // snapshot; reuse shm now
//   ...on the engine: WaitForVersion, then Apply into its DESTINATION buffers.
//
// A Client is thread-safe (gRPC channels and stubs are); a SharedMemory is not synchronized.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/refit/v1/refit.grpc.pb.h"

namespace refit::client {

// `$REFIT_SOCKET`, else /run/refit/refitd.sock.
std::string DefaultSocketPath();

// A POSIX shared-memory object mapped read-write into this process. Create() makes (and owns:
// unlinks on destruction) a new object; Open() maps an existing one.
class SharedMemory {
 public:
  // ALREADY_EXISTS if `name` exists (pass replace=true to unlink a leftover first).
  static absl::StatusOr<SharedMemory> Create(const std::string& name, uint64_t size,
                                             bool replace = false);
  static absl::StatusOr<SharedMemory> Open(const std::string& name);

  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedMemory(std::string name, uint8_t* data, uint64_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}
  void Reset();

  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
};

// A TensorSlice message. Empty offsets/sizes mean the whole tensor; empty strides row-major.
v1::TensorSlice Slice(const std::string& name, v1::DType dtype,
                      const std::vector<int64_t>& global_shape, uint64_t buffer_offset = 0,
                      const std::vector<int64_t>& offsets = {},
                      const std::vector<int64_t>& sizes = {},
                      const std::vector<int64_t>& buffer_strides = {});

// Bytes per element of `dtype` (0 for DTYPE_UNSPECIFIED).
uint64_t DTypeBytes(v1::DType dtype);

// A live Watch: one VersionEvent per version that completes on the node.
class Watcher {
 public:
  virtual ~Watcher() = default;
  // Blocks for the next event; false when the stream ended (see status()).
  virtual bool Next(v1::VersionEvent* event) = 0;
  // Ends the stream from any thread; Next then returns false.
  virtual void Cancel() = 0;
  virtual absl::Status status() = 0;
};

class LeaseKeeper;

class Client {
 public:
  ~Client();
  // Connects to the daemon at `socket_path`. UNAVAILABLE at once when the socket file does not
  // exist or nothing listens on it (PERMISSION_DENIED when this user may not connect); waits up
  // to `timeout` only for a socket that is there and slow, then UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& socket_path = DefaultSocketPath(),
      std::chrono::milliseconds timeout = std::chrono::seconds(5));

  absl::StatusOr<std::string> RegisterBuffer(const v1::RegisterBufferRequest& request);
  // Registers [offset, offset + size) of `shm` (size 0: to the end).
  absl::StatusOr<std::string> RegisterBuffer(const std::string& model, v1::Role role,
                                             const std::string& shm_name,
                                             const std::vector<v1::TensorSlice>& tensors,
                                             const std::string& client_name = "",
                                             uint64_t offset = 0, uint64_t size = 0);
  absl::Status ReleaseBuffer(const std::string& buffer_id);
  absl::StatusOr<v1::PublishResponse> Publish(const std::string& model, uint64_t version,
                                              const std::vector<std::string>& buffer_ids);
  // DEADLINE_EXCEEDED when no version >= min_version completes within `timeout`.
  absl::StatusOr<uint64_t> WaitForVersion(const std::string& model, uint64_t min_version,
                                          std::chrono::milliseconds timeout);
  absl::StatusOr<v1::ApplyResponse> Apply(const std::string& model, uint64_t version,
                                          const std::vector<std::string>& buffer_ids);
  // Blocks until `version` or newer is complete on at least `min_nodes` of the nodes with
  // DESTINATION buffers for `model` (0: all of them), as this node's daemon knows them; a
  // trainer's staleness control. DEADLINE_EXCEEDED after `timeout`, naming who is behind.
  absl::StatusOr<v1::WaitForReplicasResponse> WaitForReplicas(const std::string& model,
                                                              uint64_t version,
                                                              uint32_t min_nodes,
                                                              std::chrono::milliseconds timeout);
  absl::StatusOr<v1::StatusResponse> Status();
  // Releases `model`'s held versions and forgets it (and its remembered newest version, so a
  // new run may start at 1). FAILED_PRECONDITION while buffers of it are registered.
  absl::StatusOr<v1::DropModelResponse> DropModel(const std::string& model);
  // Starts a watch; returns once the daemon has it in place, so no later completion is missed.
  // `after_version` > 0 also replays retained versions newer than it.
  absl::StatusOr<std::unique_ptr<Watcher>> Watch(const std::string& model,
                                                 uint64_t after_version = 0);
  // SERVING / NOT_SERVING of grpc.health.v1 for `service` ("" = the whole daemon).
  absl::StatusOr<bool> Healthy(const std::string& service = "");

  // Deadline of calls that don't wait for versions (default 60 s).
  void set_call_timeout(std::chrono::milliseconds timeout) { call_timeout_ = timeout; }
  const std::string& socket_path() const { return socket_path_; }

 private:
  Client(std::string socket_path, std::shared_ptr<grpc::Channel> channel);
  void SetDeadline(grpc::ClientContext* context) const;

  std::string socket_path_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Refit::Stub> stub_;
  std::chrono::milliseconds call_timeout_{60000};
  // Renews leases when refitd can't watch this process (RegisterBufferResponse.lease_ms).
  std::unique_ptr<LeaseKeeper> leases_;
};

// grpc::Status to absl::Status (same codes), prefixed with `what`.
absl::Status FromGrpc(const grpc::Status& status, const std::string& what);

}  // namespace refit::client
