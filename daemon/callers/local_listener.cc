#include "daemon/callers/local_listener.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"

namespace refit::callers {
namespace {
constexpr int kMaxMessageBytes = 64 << 20;  // registrations of models with many tensors
}  // namespace

absl::StatusOr<std::unique_ptr<LocalListener>> LocalListener::Start(
    const std::string& path, mode_t mode, Policy policy, ServiceFactory factory,
    std::shared_ptr<FdExchange> fd_exchange) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--socket path is unusable: ", path));
  }
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  // The socket file gets its final mode as it is created: nobody can connect to it in between.
  const mode_t old_mask = umask(static_cast<mode_t>(~mode & 0777));
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_error = errno;
  umask(old_mask);
  if (bound != 0 || listen(fd, 128) != 0) {
    const int error = bound != 0 ? bind_error : errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", path, ": ", std::strerror(error)));
  }
  std::unique_ptr<LocalListener> listener(
      new LocalListener(path, fd, std::move(policy), std::move(factory)));
  {
    // The daemon's own class is built now: a Start that fails does so before it is serving.
    std::lock_guard<std::mutex> lock(listener->mu_);
    Caller self;
    self.pid = getpid();
    self.uid = listener->policy_.daemon_uid;
    self.gid = getegid();
    self.groups = {self.gid};
    if (!listener->ServerFor(&self)) {
      return absl::InternalError("cannot start the local gRPC server");
    }
  }
  // memfd passing (fd_exchange.h): connections that turn out to be gRPC come back to Route.
  if (fd_exchange) {
    listener->fd_exchange_ = std::move(fd_exchange);
    listener->fd_exchange_->StartSorting([raw = listener.get()](int fd) { raw->Route(fd); });
  }
  listener->accept_thread_ = std::thread([raw = listener.get()] { raw->Accept(); });
  return listener;
}

LocalListener::LocalListener(std::string path, int fd, Policy policy, ServiceFactory factory)
    : path_(std::move(path)), fd_(fd), policy_(std::move(policy)), factory_(std::move(factory)) {}

LocalListener::~LocalListener() { Shutdown(); }

void LocalListener::Accept() {
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, 200);
    if (ready <= 0) continue;
    // gRPC's endpoints expect non-blocking sockets.
    const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (client < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        Logger("server")->warn("cannot accept a local connection: {}", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    if (fd_exchange_ && fd_exchange_->Divert(client)) continue;  // memfd passing, or not yet known
    Route(client);
  }
}

void LocalListener::Route(int fd) {
  auto caller = PeerOf(fd);
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) {
    close(fd);
    return;
  }
  const bool allowed = caller.ok() && policy_.Allows(*caller);
  if (!allowed) {
    const uid_t uid = caller.ok() ? caller->uid : static_cast<uid_t>(-1);
    if (!logged_refusal_[uid]) {
      logged_refusal_[uid] = true;  // once per uid: no log floods
      Logger("server")->warn("local caller {} is not allowed (allowed: {}); it gets "
                             "PERMISSION_DENIED",
                             caller.ok() ? caller->Describe() : caller.status().ToString(),
                             policy_.Describe());
    }
  }
  Served* served = ServerFor(allowed ? &*caller : nullptr);
  if (!served) {
    close(fd);
    return;
  }
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
  params.listener_fd = fd_;
  params.fd = fd;  // gRPC owns it from here
  served->acceptor->HandleNewConnection(&params);
}

LocalListener::Served* LocalListener::ServerFor(const Caller* caller) {
  std::unique_ptr<Served>& slot = caller ? by_uid_[caller->uid] : refused_;
  if (slot) return slot.get();
  auto served = std::make_unique<Served>();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  served->acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      grpc::InsecureServerCredentials());
  served->keep = factory_(caller, &builder);
  served->server = builder.BuildAndStart();
  if (!served->server) {
    by_uid_.erase(caller ? caller->uid : static_cast<uid_t>(-1));
    return nullptr;
  }
  slot = std::move(served);
  return slot.get();
}

void LocalListener::Shutdown(std::chrono::milliseconds grace) {
  if (stop_.exchange(true)) return;
  if (accept_thread_.joinable()) accept_thread_.join();
  if (fd_exchange_) fd_exchange_->StopSorting();  // no Route from it after this
  close(fd_);
  std::vector<Served*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down_ = true;
    for (auto& [uid, served] : by_uid_) all.push_back(served.get());
    if (refused_) all.push_back(refused_.get());
  }
  const auto deadline = std::chrono::system_clock::now() + grace;
  for (Served* served : all) served->server->Shutdown(deadline);
  unlink(path_.c_str());
}

}  // namespace refit::callers
