#pragma once

// The C++ client library for refit: what trainer ranks, inference engines, refitctl, the demo
// and the integration tests use to talk to their node's refitd over its Unix socket.
//
//   auto shm = SharedMemory::CreateSealed(bytes, "trainer-rank0"); // the weights live here
//   auto client = Client::Connect();                               // $REFIT_SOCKET or default
//   auto id = client->RegisterBuffer("llama", v1::SOURCE, *shm, {Slice("w", v1::BF16, {4096})});
//   client->Publish("llama", 1, {*id});                             // snapshot; reuse shm now
//   ...on the engine: WaitForVersion, then Apply into its DESTINATION buffers.
//
// A Client is thread-safe (gRPC channels and stubs are); a SharedMemory is not synchronized.
//
// Riding out a restarted refitd (issue 18): a Client that registered buffers, when a call
// answers UNAVAILABLE (refitd is down) or NOT_FOUND (refitd does not know one of its buffers),
// waits for refitd to answer again (retrying with a 0.1-1 s backoff, up to restart_timeout),
// registers its buffers again if refitd no longer knows them (a sealed memfd is passed anew, a
// named shm object goes by its name), and retries the call once. Callers keep the ids they
// were given: the Client maps them to the new ones. Leases follow the new ids; a Watch
// resumes after the last version it delivered.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/refit/v1/refit.grpc.pb.h"

namespace refit::client {

// `$REFIT_SOCKET`, else /run/refit/refitd.sock.
std::string DefaultSocketPath();

// Shared memory mapped read-write into this process, of one of two kinds:
//   - CreateSealed() (the default for new buffers): an anonymous memfd sealed against shrinking
//     and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL). Nobody can truncate it under
//     refitd; Client::RegisterBuffer passes its fd to refitd over the socket (SCM_RIGHTS).
//     Nothing to clean up: the memory goes with the last fd and mapping.
//   - Create() / Open(): a named POSIX shm object (refitd opens it by name, with the caller's
//     access checked). Create() makes (and owns: unlinks on destruction) a new object; Open()
//     maps an existing one.
class SharedMemory {
 public:
  // `label` names it in /proc and refitd's logs ("memfd:trainer-rank0"); not unique.
  static absl::StatusOr<SharedMemory> CreateSealed(uint64_t size,
                                                   const std::string& label = "refit");
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
  // The shm_open name; empty for a sealed memfd.
  const std::string& name() const { return name_; }
  // The memfd (owned; closed on destruction); -1 for a named object.
  int fd() const { return fd_; }
  bool sealed() const { return fd_ >= 0; }

 private:
  SharedMemory(std::string name, uint8_t* data, uint64_t size, bool owner, int fd = -1)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner), fd_(fd) {}
  void Reset();

  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
  int fd_ = -1;
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
class Registrations;
struct Recoveries;

class Client {
 public:
  ~Client();
  // Connects to the daemon at `socket_path`. UNAVAILABLE at once when the socket file does not
  // exist or nothing listens on it (PERMISSION_DENIED when this user may not connect); waits up
  // to `timeout` only for a socket that is there and slow, then UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& socket_path = DefaultSocketPath(),
      std::chrono::milliseconds timeout = std::chrono::seconds(5));

  // Registering the same memory (the same shm object or memfd, offset and size) the same way
  // again returns the same id (refitd's registration is idempotent for its caller); the same
  // memory registered otherwise is ALREADY_EXISTS naming the buffer that has it.
  // A request naming a memfd token is not registered again after a restart (its token is
  // spent): use the SharedMemory overload for that.
  absl::StatusOr<std::string> RegisterBuffer(const v1::RegisterBufferRequest& request);
  // Registers [offset, offset + size) of `memory` (size 0: to the end): a sealed memfd is
  // passed to refitd (PassMemfd), a named object goes by its name.
  absl::StatusOr<std::string> RegisterBuffer(const std::string& model, v1::Role role,
                                             const SharedMemory& memory,
                                             const std::vector<v1::TensorSlice>& tensors,
                                             const std::string& client_name = "",
                                             uint64_t offset = 0, uint64_t size = 0);
  // Registers [offset, offset + size) of the POSIX shm object `shm_name` (size 0: to the end).
  absl::StatusOr<std::string> RegisterBuffer(const std::string& model, v1::Role role,
                                             const std::string& shm_name,
                                             const std::vector<v1::TensorSlice>& tensors,
                                             const std::string& client_name = "",
                                             uint64_t offset = 0, uint64_t size = 0);
  // Passes the memfd `fd` (this process keeps it) to refitd over the socket with SCM_RIGHTS;
  // returns the token that names it in one RegisterBuffer (MemoryHandle.memfd) by this uid,
  // within 60 s. Errors carry refitd's code (PERMISSION_DENIED for a refused caller,
  // RESOURCE_EXHAUSTED when this uid holds too many unregistered fds there).
  absl::StatusOr<std::string> PassMemfd(int fd);
  absl::Status ReleaseBuffer(const std::string& buffer_id);
  // `run`: the trainer's run (PublishRequest.run; empty: the model's current run). Another run
  // than the current one starts it: a resume from a checkpoint may publish numbers below the
  // old run's, and engines' nodes follow it.
  absl::StatusOr<v1::PublishResponse> Publish(const std::string& model, uint64_t version,
                                              const std::vector<std::string>& buffer_ids,
                                              const std::string& run = "");
  // The same, with the rest of `with` (labels, max_staleness, run, ...: every field but model,
  // version and buffer_ids, which come from the arguments). With max_staleness the call waits
  // (within the client's call timeout) until every replica holds version - max_staleness.
  absl::StatusOr<v1::PublishResponse> Publish(const std::string& model, uint64_t version,
                                              const std::vector<std::string>& buffer_ids,
                                              const v1::PublishRequest& with);
  // Each node's stages of `model`'s `version` (0: every version remembered), from this node
  // and every node reachable from it (`local`: this node only).
  absl::StatusOr<v1::TimelineResponse> Timeline(const std::string& model, uint64_t version = 0,
                                                bool local = false);
  // DEADLINE_EXCEEDED when no version >= min_version completes within `timeout`.
  absl::StatusOr<uint64_t> WaitForVersion(const std::string& model, uint64_t min_version,
                                          std::chrono::milliseconds timeout);
  // WaitForVersion with the run the caller last saw (`run`; empty: any): answers at once, even
  // below min_version, when the model's run is another one (a new run restarts its numbers);
  // the response names the version's run and whether it is a rollback target.
  absl::StatusOr<v1::WaitForVersionResponse> WaitForTarget(const std::string& model,
                                                           uint64_t min_version,
                                                           const std::string& run,
                                                           std::chrono::milliseconds timeout);
  // Rolls every node with DESTINATION buffers for `model` back to the retained `version`
  // (NOT_FOUND naming the oldest retained otherwise); newer versions are held back until
  // Resume (FAILED_PRECONDITION when the model is not held back).
  absl::StatusOr<uint64_t> Rollback(const std::string& model, uint64_t version);
  absl::Status Resume(const std::string& model);
  absl::StatusOr<v1::ApplyResponse> Apply(const std::string& model, uint64_t version,
                                          const std::vector<std::string>& buffer_ids);
  // Blocks until `version` or newer is complete on at least `min_nodes` of the nodes with
  // DESTINATION buffers for `model` (0: all of them), as this node's daemon knows them; a
  // trainer's staleness control. DEADLINE_EXCEEDED after `timeout`, naming who is behind.
  absl::StatusOr<v1::WaitForReplicasResponse> WaitForReplicas(const std::string& model,
                                                              uint64_t version, uint32_t min_nodes,
                                                              std::chrono::milliseconds timeout);
  absl::StatusOr<v1::StatusResponse> Status();
  // Releases `model`'s held versions and forgets it (and its remembered newest version, so a
  // new run may start at 1). FAILED_PRECONDITION while buffers of it are registered.
  absl::StatusOr<v1::DropModelResponse> DropModel(const std::string& model);
  // Compares `model`'s DESTINATION buffers on this node with the versions their last Apply
  // installed; DATA_LOSS naming the buffers and tensors that differ.
  absl::StatusOr<v1::VerifyResponse> Verify(const std::string& model);
  // Starts a watch; returns once the daemon has it in place, so no later completion is missed.
  // `after_version` > 0 also replays retained versions newer than it.
  absl::StatusOr<std::unique_ptr<Watcher>> Watch(const std::string& model,
                                                 uint64_t after_version = 0);
  // SERVING / NOT_SERVING of grpc.health.v1 for `service` ("" = the whole daemon).
  absl::StatusOr<bool> Healthy(const std::string& service = "");

  // Deadline of calls that don't wait for versions (default 60 s).
  void set_call_timeout(std::chrono::milliseconds timeout) { call_timeout_ = timeout; }
  // How long a call waits for a restarted refitd before it answers UNAVAILABLE (default 60 s;
  // 0: no waiting, no registering again, no retry).
  void set_restart_timeout(std::chrono::milliseconds timeout) { restart_timeout_ = timeout; }
  const std::string& socket_path() const { return socket_path_; }
  // Times this Client registered its buffers again on a restarted refitd.
  uint64_t restarts_ridden() const;

  // ---- for the Watcher (refit_client.cc) ----
  // After a call (made at registrations generation `generation`) answered `error`: waits for
  // refitd, registers the buffers again where refitd lost them; true when the call is worth
  // retrying. False at once for other codes, for a Client without buffers, or with
  // restart_timeout 0.
  bool Recover(const absl::Status& error, uint64_t generation);
  // For a Watch stream that ended with `error`: Recover for a Client with buffers; for one
  // without, true once refitd answers again after UNAVAILABLE (within restart_timeout), as the
  // Python client's watch does.
  bool AwaitRefitd(const absl::Status& error, uint64_t generation);
  uint64_t generation() const;
  v1::Refit::Stub* stub() const { return stub_.get(); }

 private:
  Client(std::string socket_path, std::shared_ptr<grpc::Channel> channel);
  void SetDeadline(grpc::ClientContext* context) const;
  // `call`, and once more after Recover says so.
  template <typename T>
  absl::StatusOr<T> WithRestart(const std::function<absl::StatusOr<T>()>& call);
  absl::StatusOr<v1::RegisterBufferResponse> RegisterOnce(const v1::RegisterBufferRequest& request);
  // refitd's Status once it answers, within restart_timeout.
  std::optional<v1::StatusResponse> StatusWhenBack();
  absl::Status RegisterAgain();

  std::string socket_path_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Refit::Stub> stub_;
  std::chrono::milliseconds call_timeout_{60000};
  // Renews leases when refitd can't watch this process (RegisterBufferResponse.lease_ms).
  std::unique_ptr<LeaseKeeper> leases_;
  std::chrono::milliseconds restart_timeout_{60000};
  std::unique_ptr<Registrations> registrations_;
  std::unique_ptr<Recoveries> recoveries_;  // one at a time, counted (registrations.h)
};

// grpc::Status to absl::Status (same codes), prefixed with `what`.
absl::Status FromGrpc(const grpc::Status& status, const std::string& what);

}  // namespace refit::client
