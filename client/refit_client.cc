#include "client/refit_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/lease_keeper.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace refit::client {

std::string DefaultSocketPath() {
  const char* env = std::getenv("REFIT_SOCKET");
  return env && *env ? env : "/run/refit/refitd.sock";
}

absl::Status FromGrpc(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

// ---- SharedMemory ----

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t size,
                                                  bool replace) {
  if (size == 0) return absl::InvalidArgumentError("shared memory size must be > 0");
  if (replace) shm_unlink(name.c_str());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0660);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) return absl::AlreadyExistsError(absl::StrCat(name, " already exists"));
    return absl::InvalidArgumentError(absl::StrCat("shm_open ", name, ": ", std::strerror(err)));
  }
  // The daemon may run as another user of the same group: the umask must not take g+rw away.
  (void)fchmod(fd, 0660);
  // posix_fallocate reserves the pages now, so running out of /dev/shm is an error here rather
  // than a SIGBUS later.
  int err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve ", size, " bytes for ", name, ": ", std::strerror(err)));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", name, ": ", std::strerror(err)));
  }
  return SharedMemory(name, static_cast<uint8_t*>(p), size, /*owner=*/true);
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    return absl::InvalidArgumentError(absl::StrCat("shm_open ", name, ": ", std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(name, " is empty"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", name, ": ", std::strerror(err)));
  }
  return SharedMemory(name, static_cast<uint8_t*>(p), size, /*owner=*/false);
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept { *this = std::move(other); }

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
  }
  return *this;
}

SharedMemory::~SharedMemory() { Reset(); }

void SharedMemory::Reset() {
  if (data_) munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
  data_ = nullptr;
  owner_ = false;
}

// ---- helpers ----

v1::TensorSlice Slice(const std::string& name, v1::DType dtype,
                      const std::vector<int64_t>& global_shape, uint64_t buffer_offset,
                      const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                      const std::vector<int64_t>& buffer_strides) {
  v1::TensorSlice s;
  s.set_name(name);
  s.set_dtype(dtype);
  for (int64_t d : global_shape) s.add_global_shape(d);
  for (int64_t d : offsets) s.add_offsets(d);
  for (int64_t d : sizes) s.add_sizes(d);
  s.set_buffer_offset(buffer_offset);
  for (int64_t d : buffer_strides) s.add_buffer_strides(d);
  return s;
}

uint64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::BF16:
    case v1::FP16:
      return 2;
    case v1::FP32:
    case v1::INT32:
      return 4;
    case v1::INT64:
      return 8;
    case v1::FP8_E4M3:
    case v1::FP8_E5M2:
    case v1::INT8:
    case v1::UINT8:
      return 1;
    default:
      return 0;
  }
}

// ---- Client ----

Client::Client(std::string socket_path, std::shared_ptr<grpc::Channel> channel)
    : socket_path_(std::move(socket_path)),
      channel_(std::move(channel)),
      stub_(v1::Refit::NewStub(channel_)),
      leases_(std::make_unique<LeaseKeeper>(stub_.get())) {}

Client::~Client() = default;

namespace {

// What a plain connect() to the Unix socket at `path` says. A socket file that is missing or
// that nothing listens on will not start answering within any timeout worth waiting for, so
// those are told at once; a socket that accepts (or is slow to) is left to gRPC.
absl::Status ProbeSocket(const std::string& path) {
  const std::string hint =
      " (is refitd running? --socket or $REFIT_SOCKET select another socket)";
  if (path.empty()) return absl::InvalidArgumentError("the socket path is empty");
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path is too long for a Unix socket: ", path));
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::UnavailableError(
          absl::StrCat("no refitd at ", path, ": the socket does not exist", hint));
    }
    return absl::UnavailableError(
        absl::StrCat("cannot reach ", path, ": ", std::strerror(err), hint));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(
        absl::StrCat("no refitd at ", path, ": it exists but is not a socket", hint));
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::OkStatus();  // let gRPC try and report
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = rc == 0 ? 0 : errno;
  close(fd);
  if (err == ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(
        "no refitd at ", path, ": nothing listens on the socket (a refitd that exited left it)",
        hint));
  }
  if (err == EACCES || err == EPERM) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot connect to ", path, ": ", std::strerror(err),
        " (the socket is group-accessible: run as refitd's user or a member of its group)"));
  }
  return absl::OkStatus();  // connected, or EAGAIN (a backlog full: slow, worth the wait)
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& socket_path,
                                                        std::chrono::milliseconds timeout) {
  if (absl::Status probe = ProbeSocket(socket_path); !probe.ok()) return probe;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel("unix:" + socket_path,
                                           grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + timeout)) {
    return absl::UnavailableError(
        absl::StrCat("no refitd answers at ", socket_path, " within ", timeout.count(),
                     " ms (the socket exists; is refitd stuck? --socket or $REFIT_SOCKET ",
                     "select another socket)"));
  }
  return std::unique_ptr<Client>(new Client(socket_path, std::move(channel)));
}

void Client::SetDeadline(grpc::ClientContext* context) const {
  context->set_deadline(std::chrono::system_clock::now() + call_timeout_);
}

absl::StatusOr<std::string> Client::RegisterBuffer(const v1::RegisterBufferRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RegisterBufferResponse response;
  auto status = FromGrpc(stub_->RegisterBuffer(&context, request, &response), "RegisterBuffer");
  if (!status.ok()) return status;
  if (response.lease_ms() > 0) leases_->Add(response.buffer_id(), response.lease_ms());
  return response.buffer_id();
}

absl::StatusOr<std::string> Client::RegisterBuffer(const std::string& model, v1::Role role,
                                                   const std::string& shm_name,
                                                   const std::vector<v1::TensorSlice>& tensors,
                                                   const std::string& client_name,
                                                   uint64_t offset, uint64_t size) {
  v1::RegisterBufferRequest request;
  request.set_model(model);
  request.set_role(role);
  request.mutable_memory()->mutable_host_shm()->set_name(shm_name);
  request.mutable_memory()->set_offset(offset);
  request.mutable_memory()->set_size(size);
  for (const auto& t : tensors) *request.add_tensors() = t;
  request.set_client(client_name);
  return RegisterBuffer(request);
}

absl::Status Client::ReleaseBuffer(const std::string& buffer_id) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ReleaseBufferRequest request;
  request.set_buffer_id(buffer_id);
  v1::ReleaseBufferResponse response;
  leases_->Remove(buffer_id);
  return FromGrpc(stub_->ReleaseBuffer(&context, request, &response), "ReleaseBuffer");
}

absl::StatusOr<v1::PublishResponse> Client::Publish(const std::string& model, uint64_t version,
                                                    const std::vector<std::string>& buffer_ids) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::PublishRequest request;
  request.set_model(model);
  request.set_version(version);
  for (const auto& id : buffer_ids) request.add_buffer_ids(id);
  v1::PublishResponse response;
  auto status = FromGrpc(stub_->Publish(&context, request, &response), "Publish");
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<uint64_t> Client::WaitForVersion(const std::string& model, uint64_t min_version,
                                                std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::WaitForVersionRequest request;
  request.set_model(model);
  request.set_min_version(min_version);
  v1::WaitForVersionResponse response;
  auto status = FromGrpc(stub_->WaitForVersion(&context, request, &response), "WaitForVersion");
  if (!status.ok()) return status;
  return response.version();
}

absl::StatusOr<v1::WaitForReplicasResponse> Client::WaitForReplicas(
    const std::string& model, uint64_t version, uint32_t min_nodes,
    std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::WaitForReplicasRequest request;
  request.set_model(model);
  request.set_version(version);
  request.set_min_nodes(min_nodes);
  v1::WaitForReplicasResponse response;
  auto status =
      FromGrpc(stub_->WaitForReplicas(&context, request, &response), "WaitForReplicas");
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::ApplyResponse> Client::Apply(const std::string& model, uint64_t version,
                                                const std::vector<std::string>& buffer_ids) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ApplyRequest request;
  request.set_model(model);
  request.set_version(version);
  for (const auto& id : buffer_ids) request.add_buffer_ids(id);
  v1::ApplyResponse response;
  auto status = FromGrpc(stub_->Apply(&context, request, &response), "Apply");
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::StatusResponse> Client::Status() {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::StatusResponse response;
  auto status = FromGrpc(stub_->Status(&context, v1::StatusRequest(), &response), "Status");
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::DropModelResponse> Client::DropModel(const std::string& model) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::DropModelRequest request;
  request.set_model(model);
  v1::DropModelResponse response;
  auto status = FromGrpc(stub_->DropModel(&context, request, &response), "DropModel");
  if (!status.ok()) return status;
  return response;
}

namespace {

class StreamWatcher final : public Watcher {
 public:
  StreamWatcher(v1::Refit::Stub* stub, const v1::WatchRequest& request)
      : reader_(stub->Watch(&context_, request)) {}
  bool Start() {
    reader_->WaitForInitialMetadata();
    return true;
  }
  bool Next(v1::VersionEvent* event) override { return reader_->Read(event); }
  void Cancel() override { context_.TryCancel(); }
  absl::Status status() override {
    if (!finished_) {
      final_ = FromGrpc(reader_->Finish(), "Watch");
      finished_ = true;
    }
    return final_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::VersionEvent>> reader_;
  bool finished_ = false;
  absl::Status final_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Watcher>> Client::Watch(const std::string& model,
                                                       uint64_t after_version) {
  v1::WatchRequest request;
  request.set_model(model);
  request.set_after_version(after_version);
  auto watcher = std::make_unique<StreamWatcher>(stub_.get(), request);
  watcher->Start();
  return std::unique_ptr<Watcher>(std::move(watcher));
}

absl::StatusOr<bool> Client::Healthy(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  auto status = FromGrpc(stub->Check(&context, request, &response), "Health.Check");
  if (!status.ok()) return status;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace refit::client
