#include "client/refit_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/lease_keeper.h"
#include "client/registrations.h"
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

// ---- Client ----

Client::Client(std::string socket_path, std::shared_ptr<grpc::Channel> channel)
    : socket_path_(std::move(socket_path)),
      channel_(std::move(channel)),
      stub_(v1::Refit::NewStub(channel_)),
      leases_(std::make_unique<LeaseKeeper>(stub_.get())),
      registrations_(std::make_unique<Registrations>()),
      recoveries_(std::make_unique<Recoveries>()) {}

Client::~Client() = default;

namespace {

// What a plain connect() to the Unix socket at `path` says. A socket file that is missing or
// that nothing listens on will not start answering within any timeout worth waiting for, so
// those are told at once; a socket that accepts (or is slow to) is left to gRPC.
absl::Status ProbeSocket(const std::string& path) {
  const std::string hint = " (is refitd running? --socket or $REFIT_SOCKET select another socket)";
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
    return absl::UnavailableError(
        absl::StrCat("no refitd at ", path,
                     ": nothing listens on the socket (a refitd that exited left it)", hint));
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
  // A restarted refitd is found again within a second (gRPC's default backoff grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel =
      grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
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

template <typename T>
absl::StatusOr<T> Client::WithRestart(const std::function<absl::StatusOr<T>()>& call) {
  const uint64_t generation = registrations_->generation();
  absl::StatusOr<T> result = call();
  if (result.ok() || !Recover(result.status(), generation)) return result;
  return call();
}

absl::StatusOr<v1::RegisterBufferResponse> Client::RegisterOnce(
    const v1::RegisterBufferRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RegisterBufferResponse response;
  auto status = FromGrpc(stub_->RegisterBuffer(&context, request, &response), "RegisterBuffer");
  if (!status.ok()) return status;
  if (response.lease_ms() > 0) leases_->Add(response.buffer_id(), response.lease_ms());
  return response;
}

absl::StatusOr<std::string> Client::RegisterBuffer(const v1::RegisterBufferRequest& request) {
  auto response = WithRestart<v1::RegisterBufferResponse>([&] { return RegisterOnce(request); });
  if (!response.ok()) return response.status();
  // A memfd token serves one registration: such a request can't be made again.
  if (!request.memory().has_memfd()) registrations_->Add(response->buffer_id(), request, -1);
  return response->buffer_id();
}

absl::StatusOr<std::string> Client::RegisterBuffer(const std::string& model, v1::Role role,
                                                   const std::string& shm_name,
                                                   const std::vector<v1::TensorSlice>& tensors,
                                                   const std::string& client_name, uint64_t offset,
                                                   uint64_t size) {
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

absl::StatusOr<std::string> Client::RegisterBuffer(const std::string& model, v1::Role role,
                                                   const SharedMemory& memory,
                                                   const std::vector<v1::TensorSlice>& tensors,
                                                   const std::string& client_name, uint64_t offset,
                                                   uint64_t size) {
  if (!memory.sealed()) {
    return RegisterBuffer(model, role, memory.name(), tensors, client_name, offset, size);
  }
  v1::RegisterBufferRequest request;
  request.set_model(model);
  request.set_role(role);
  request.mutable_memory()->set_offset(offset);
  request.mutable_memory()->set_size(size);
  for (const auto& t : tensors) *request.add_tensors() = t;
  request.set_client(client_name);
  // The memfd is passed for each try (a token serves one registration).
  auto response =
      WithRestart<v1::RegisterBufferResponse>([&]() -> absl::StatusOr<v1::RegisterBufferResponse> {
        auto token = PassMemfd(memory.fd());
        if (!token.ok()) return token.status();
        v1::RegisterBufferRequest with_token = request;
        with_token.mutable_memory()->mutable_memfd()->set_token(*token);
        return RegisterOnce(with_token);
      });
  if (!response.ok()) return response.status();
  registrations_->Add(response->buffer_id(), request, memory.fd());
  return response->buffer_id();
}

namespace {

using SystemTime = std::chrono::system_clock::time_point;

// One unary call of `method` with `request`, ending by `deadline`.
template <typename Request, typename Response>
absl::StatusOr<Response> Call(v1::Refit::Stub* stub,
                              grpc::Status (v1::Refit::Stub::*method)(grpc::ClientContext*,
                                                                      const Request&, Response*),
                              const char* what, const Request& request, SystemTime deadline) {
  grpc::ClientContext context;
  context.set_deadline(deadline);
  Response response;
  auto status = FromGrpc((stub->*method)(&context, request, &response), what);
  if (!status.ok()) return status;
  return response;
}

template <typename Request>
void AddIds(const std::vector<std::string>& ids, Request* request) {
  for (const auto& id : ids) request->add_buffer_ids(id);
}

}  // namespace

absl::Status Client::ReleaseBuffer(const std::string& buffer_id) {
  // Forgotten first: after a restart of refitd it is not registered again, and the retry
  // answers NOT_FOUND (it is gone either way).
  const std::string current = registrations_->Remove(buffer_id);
  leases_->Remove(current);
  return WithRestart<v1::ReleaseBufferResponse>([&] {
           v1::ReleaseBufferRequest request;
           request.set_buffer_id(current);
           return Call(stub_.get(), &v1::Refit::Stub::ReleaseBuffer, "ReleaseBuffer", request,
                       std::chrono::system_clock::now() + call_timeout_);
         })
      .status();
}

absl::StatusOr<v1::PublishResponse> Client::Publish(const std::string& model, uint64_t version,
                                                    const std::vector<std::string>& buffer_ids,
                                                    const std::string& run) {
  return WithRestart<v1::PublishResponse>([&] {
    v1::PublishRequest request;
    request.set_model(model);
    request.set_version(version);
    request.set_run(run);
    AddIds(registrations_->Current(buffer_ids), &request);
    return Call(stub_.get(), &v1::Refit::Stub::Publish, "Publish", request,
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<v1::PublishResponse> Client::Publish(const std::string& model, uint64_t version,
                                                    const std::vector<std::string>& buffer_ids,
                                                    const v1::PublishRequest& with) {
  return WithRestart<v1::PublishResponse>([&] {
    v1::PublishRequest request = with;
    request.set_model(model);
    request.set_version(version);
    request.clear_buffer_ids();
    AddIds(registrations_->Current(buffer_ids), &request);
    return Call(stub_.get(), &v1::Refit::Stub::Publish, "Publish", request,
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<v1::TimelineResponse> Client::Timeline(const std::string& model, uint64_t version,
                                                      bool local) {
  v1::TimelineRequest request;
  request.set_model(model);
  request.set_version(version);
  request.set_local(local);
  return WithRestart<v1::TimelineResponse>([&] {
    return Call(stub_.get(), &v1::Refit::Stub::Timeline, "Timeline", request,
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<uint64_t> Client::WaitForVersion(const std::string& model, uint64_t min_version,
                                                std::chrono::milliseconds timeout) {
  const SystemTime deadline = std::chrono::system_clock::now() + timeout;
  v1::WaitForVersionRequest request;
  request.set_model(model);
  request.set_min_version(min_version);
  auto response = WithRestart<v1::WaitForVersionResponse>([&] {
    return Call(stub_.get(), &v1::Refit::Stub::WaitForVersion, "WaitForVersion", request, deadline);
  });
  if (!response.ok()) return response.status();
  return response->version();
}

absl::StatusOr<v1::WaitForVersionResponse> Client::WaitForTarget(
    const std::string& model, uint64_t min_version, const std::string& run,
    std::chrono::milliseconds timeout) {
  const SystemTime deadline = std::chrono::system_clock::now() + timeout;
  v1::WaitForVersionRequest request;
  request.set_model(model);
  request.set_min_version(min_version);
  request.set_run(run);
  return WithRestart<v1::WaitForVersionResponse>([&] {
    return Call(stub_.get(), &v1::Refit::Stub::WaitForVersion, "WaitForVersion", request, deadline);
  });
}

absl::StatusOr<uint64_t> Client::Rollback(const std::string& model, uint64_t version) {
  v1::RollbackRequest request;
  request.set_model(model);
  request.set_version(version);
  auto response = Call(stub_.get(), &v1::Refit::Stub::Rollback, "Rollback", request,
                       std::chrono::system_clock::now() + call_timeout_);
  if (!response.ok()) return response.status();
  return response->version();
}

absl::Status Client::Resume(const std::string& model) {
  v1::ResumeRequest request;
  request.set_model(model);
  return Call(stub_.get(), &v1::Refit::Stub::Resume, "Resume", request,
              std::chrono::system_clock::now() + call_timeout_)
      .status();
}

absl::StatusOr<v1::WaitForReplicasResponse> Client::WaitForReplicas(
    const std::string& model, uint64_t version, uint32_t min_nodes,
    std::chrono::milliseconds timeout) {
  v1::WaitForReplicasRequest request;
  request.set_model(model);
  request.set_version(version);
  request.set_min_nodes(min_nodes);
  return Call(stub_.get(), &v1::Refit::Stub::WaitForReplicas, "WaitForReplicas", request,
              std::chrono::system_clock::now() + timeout);
}

absl::StatusOr<v1::ApplyResponse> Client::Apply(const std::string& model, uint64_t version,
                                                const std::vector<std::string>& buffer_ids) {
  return WithRestart<v1::ApplyResponse>([&] {
    v1::ApplyRequest request;
    request.set_model(model);
    request.set_version(version);
    AddIds(registrations_->Current(buffer_ids), &request);
    return Call(stub_.get(), &v1::Refit::Stub::Apply, "Apply", request,
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<v1::StatusResponse> Client::Status() {
  return WithRestart<v1::StatusResponse>([&] {
    return Call(stub_.get(), &v1::Refit::Stub::Status, "Status", v1::StatusRequest(),
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<v1::VerifyResponse> Client::Verify(const std::string& model) {
  v1::VerifyRequest request;
  request.set_model(model);
  return WithRestart<v1::VerifyResponse>([&] {
    return Call(stub_.get(), &v1::Refit::Stub::Verify, "Verify", request,
                std::chrono::system_clock::now() + call_timeout_);
  });
}

absl::StatusOr<v1::DropModelResponse> Client::DropModel(const std::string& model) {
  v1::DropModelRequest request;
  request.set_model(model);
  return Call(stub_.get(), &v1::Refit::Stub::DropModel, "DropModel", request,
              std::chrono::system_clock::now() + call_timeout_);
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
