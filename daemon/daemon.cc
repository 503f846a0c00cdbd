// Daemon::Start assembles a refitd from its parts (Daemon::Impl, daemon_impl.h): each step is
// a method made in daemon_parts.cc (the parts) or daemon_listeners.cc (the listeners, bound
// last). Shutdown takes them down in the order that lets each finish.

#include "daemon/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/daemon_impl.h"
#include "grpcpp/grpcpp.h"

namespace refit {
namespace {

// A random id for this process, told to peers in Hello and as the run of its versions.
std::string NewInstanceId() {
  std::random_device random;
  std::mt19937_64 rng((uint64_t{random()} << 32) ^ random());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

}  // namespace

Daemon::Impl::Impl(const DaemonOptions& daemon_options)
    : options(daemon_options), instance(NewInstanceId()) {}

Daemon::Impl::~Impl() {
  if (store_probe) store_probe->Stop();
  if (bucket_import) bucket_import->Stop();
  if (deltas) deltas->Stop();
  if (bucket_export) bucket_export->Stop();
}

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  // Bad flags and a socket another refitd serves are refused before anything is made.
  RETURN_IF_ERROR(CheckDaemonOptions(options));
  ASSIGN_OR_RETURN(StoreOptions store_options, StoreOptionsFrom(options));
  auto impl = std::make_unique<Impl>(options);
  // What --state-dir kept (the ledger, the labels) is restored before anything serves.
  RETURN_IF_ERROR(impl->RestoreState());
  // The data plane first: the store's host slots may be its memory.
  RETURN_IF_ERROR(impl->MakeDataPlane(&store_options));
  impl->MakeStore(store_options);
  RETURN_IF_ERROR(impl->MakeExchange());
  RETURN_IF_ERROR(impl->CheckPeerTls());
  impl->MakePeerPlane();
  impl->ConnectEvents();
  impl->MakeLocalServices();
  impl->MakeHealth();
  // Listening last: the peer port, the local socket, then the probes' ports.
  RETURN_IF_ERROR(impl->ListenPeers());
  RETURN_IF_ERROR(impl->ListenLocal());
  if (absl::Status probes = impl->ListenProbes(); !probes.ok()) {
    impl->StopListening();
    return probes;
  }
  impl->StartServing();
  impl->LogStarted();
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::Shutdown(double grace_seconds) {
  common::MutexLock lock(impl_->shutdown_mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  Logger("daemon")->info("node={} shutting down", impl_->options.node);
  impl_->health->SetServing(false);
  if (impl_->store_probe) impl_->store_probe->Stop();
  impl_->store->Shutdown();    // blocked WaitForVersion/Watch calls return now
  impl_->replicas.Shutdown();  // and WaitForReplicas
  impl_->staleness->Stop();
  impl_->peers->Stop();
  if (impl_->bucket_import) impl_->bucket_import->Stop();
  impl_->deltas->Stop();
  if (impl_->bucket_export) impl_->bucket_export->Stop();
  impl_->peer_service->Stop();
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
  // Each step's time in the debug log: a drain that takes the whole grace period says which
  // server still had a call open (tests/faults_sigterm_test).
  const auto began = std::chrono::steady_clock::now();
  auto since = [&began] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  impl_->local_listener->Shutdown(
      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
  Logger("daemon")->debug("shutdown: local servers stopped after {:.3f} s", since());
  impl_->peer_server->Shutdown(deadline);
  Logger("daemon")->debug("shutdown: peer server stopped after {:.3f} s", since());
  if (impl_->health_server) impl_->health_server->Shutdown(deadline);
  impl_->peer_server->Wait();
  Logger("daemon")->debug("shutdown: servers done after {:.3f} s", since());
  impl_->metrics_server.reset();
  unlink(impl_->options.socket_path.c_str());
  Logger("daemon")->info("node={} stopped", impl_->options.node);
}

std::vector<std::string> Daemon::StuckWorkers(std::chrono::milliseconds stall) {
  std::vector<std::string> stuck = impl_->liveness.Stuck(stall);
  // The local gRPC server: a health check through the socket, as a client makes it.
  auto channel =
      grpc::CreateChannel("unix:" + impl_->options.socket_path, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  const auto bound = std::min<std::chrono::milliseconds>(stall, std::chrono::seconds(5));
  context.set_deadline(std::chrono::system_clock::now() + bound);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status answered = stub->Check(&context, request, &response);
  if (!answered.ok()) {
    stuck.push_back(absl::StrCat("local gRPC server (no health answer on ",
                                 impl_->options.socket_path, " within ", bound.count(),
                                 " ms: ", answered.error_message(), ")"));
  }
  return stuck;
}

int Daemon::listen_port() const { return impl_->listen_port; }

int Daemon::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : 0;
}

int Daemon::health_port() const { return impl_->health_port; }

const std::string& Daemon::node() const { return impl_->options.node; }

}  // namespace refit
