#include "daemon/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/metrics/metrics.h"
#include "daemon/server/peer_service.h"
#include "daemon/server/refit_service.h"
#include "daemon/store/store.h"
#include "daemon/version.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace refit {
namespace {

constexpr int kMaxMessageBytes = 64 << 20;  // registrations of models with many tensors

// True when something accepts connections on the Unix socket at `path`.
bool SocketIsServed(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool served = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return served;
}

absl::Status PrepareSocketPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("--socket is empty");
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket path is too long for a Unix socket: ", path));
  }
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create ", parent.string(), ": ", ec.message()));
    }
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    if (SocketIsServed(path)) {
      return absl::FailedPreconditionError(
          absl::StrCat("another refitd already serves ", path));
    }
    unlink(path.c_str());  // stale socket of a daemon that died
  }
  return absl::OkStatus();
}

}  // namespace

struct Daemon::Impl {
  DaemonOptions options;
  Metrics metrics;
  std::unique_ptr<Store> store;
  std::unique_ptr<server::RefitService> service;
  std::unique_ptr<server::PeerService> peer_service;
  std::unique_ptr<grpc::Server> local_server;
  std::unique_ptr<grpc::Server> peer_server;
  int listen_port = 0;
  std::mutex shutdown_mu;
  bool shut_down = false;
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (options.retain < 1) return absl::InvalidArgumentError("--retain must be >= 1");
  if (options.node.empty()) return absl::InvalidArgumentError("--node is empty");
  auto status = PrepareSocketPath(options.socket_path);
  if (!status.ok()) return status;

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->store = std::make_unique<Store>(
      StoreOptions{options.retain, 4ull << 30, options.node}, &impl->metrics);
  std::vector<std::string> peers = options.peers;
  server::ServiceContext context{options.node, impl->store.get(), &impl->metrics, [peers] {
                                   std::vector<server::PeerInfo> out;
                                   for (const auto& p : peers) out.push_back({"", p, false});
                                   return out;
                                 }};
  impl->service = std::make_unique<server::RefitService>(std::move(context));

  impl->peer_service = std::make_unique<server::PeerService>(options.node);

  grpc::EnableDefaultHealthCheckService(true);
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + options.socket_path, grpc::InsecureServerCredentials());
    builder.RegisterService(impl->service.get());
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    impl->local_server = builder.BuildAndStart();
    if (!impl->local_server) {
      return absl::UnavailableError(absl::StrCat("cannot serve ", options.socket_path));
    }
  }
  if (chmod(options.socket_path.c_str(), 0660) != 0) {
    Logger("daemon")->warn("chmod 0660 {}: {}", options.socket_path, std::strerror(errno));
  }
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(),
                             &impl->listen_port);
    builder.RegisterService(impl->peer_service.get());
    impl->peer_server = builder.BuildAndStart();
    if (!impl->peer_server || impl->listen_port == 0) {
      impl->local_server->Shutdown();
      unlink(options.socket_path.c_str());
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
    }
  }
  for (grpc::Server* s : {impl->local_server.get(), impl->peer_server.get()}) {
    s->GetHealthCheckService()->SetServingStatus(true);
  }
  Logger("daemon")->info("refitd {} node={} serving socket={} listen port={} retain={} {}",
                         kRefitVersion, options.node, options.socket_path, impl->listen_port,
                         options.retain, cuda::Describe());
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::Shutdown(double grace_seconds) {
  std::lock_guard<std::mutex> lock(impl_->shutdown_mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  Logger("daemon")->info("node={} shutting down", impl_->options.node);
  for (grpc::Server* s : {impl_->local_server.get(), impl_->peer_server.get()}) {
    s->GetHealthCheckService()->SetServingStatus(false);
  }
  impl_->store->Shutdown();  // blocked WaitForVersion/Watch calls return now
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
  impl_->local_server->Shutdown(deadline);
  impl_->peer_server->Shutdown(deadline);
  impl_->local_server->Wait();
  impl_->peer_server->Wait();
  unlink(impl_->options.socket_path.c_str());
  Logger("daemon")->info("node={} stopped", impl_->options.node);
}

int Daemon::listen_port() const { return impl_->listen_port; }

const std::string& Daemon::node() const { return impl_->options.node; }

}  // namespace refit
