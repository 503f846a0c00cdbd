#include "daemon/callers/local_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"

namespace refit::callers {
namespace {
constexpr int kMaxMessageBytes = 64 << 20;  // registrations of models with many tensors

// A pidfd for `pid` (Linux 5.3), -1 when the process is gone or pidfds are not available.
int OpenPidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

// True (and logged, at most every 10 s) when refitd runs `max` threads or more.
bool TooManyThreads(long max, std::chrono::steady_clock::time_point* logged) {
  const long threads = ThreadsNow();
  if (threads < 0 || threads < max) return false;
  const auto now = std::chrono::steady_clock::now();
  if (now - *logged > std::chrono::seconds(10)) {
    *logged = now;
    Logger("server")->warn(
        "refitd runs {} threads (the most at which it starts a server of its own for a new "
        "local client process: {}); new client processes share their uid's server",
        threads, max);
  }
  return true;
}

void Wake(int fd) {
  const uint64_t one = 1;
  (void)!write(fd, &one, sizeof(one));
}
}  // namespace

long ThreadsNow() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long threads = -1;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::strncmp(line, "Threads:", 8) == 0) {
      threads = std::strtol(line + 8, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return threads;
}

absl::StatusOr<std::unique_ptr<LocalListener>> LocalListener::Start(
    const std::string& path, mode_t mode, Policy policy, ServiceFactory factory,
    ClientExitListener* exits, std::shared_ptr<FdExchange> fd_exchange, ServerLimits limits) {
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
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    close(fd);
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<LocalListener> listener(
      new LocalListener(path, fd, wake_fd, std::move(policy), std::move(factory), exits, limits));
  {
    // The daemon's own class is built now: a Start that fails does so before it is serving.
    common::MutexLock lock(listener->mu_);
    Caller self;
    self.pid = 0;  // the uid's shared server
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
  listener->exit_thread_ = std::thread([raw = listener.get()] { raw->WatchExits(); });
  return listener;
}

LocalListener::LocalListener(std::string path, int fd, int wake_fd, Policy policy,
                             ServiceFactory factory, ClientExitListener* exits, ServerLimits limits)
    : path_(std::move(path)),
      fd_(fd),
      wake_fd_(wake_fd),
      policy_(std::move(policy)),
      factory_(std::move(factory)),
      exits_(exits),
      limits_(limits) {}

LocalListener::~LocalListener() {
  Shutdown();
  close(wake_fd_);
}

LocalListener::Served::~Served() {
  server.reset();  // before the services it serves
  if (pidfd >= 0) close(pidfd);
}

void LocalListener::Accept() {
  // Connections past the file-descriptor limit are refused: closed at once, so that their
  // clients see the connection end (UNAVAILABLE) instead of waiting in the backlog, and refitd
  // keeps descriptors for its own work (the memory it maps, peers, files). Descriptors are
  // handed out lowest first, so an accepted one numbered past the cap means the table is full
  // up to it. At EMFILE itself a spare descriptor is given up to take the connection and
  // close it, so the backlog never stalls (tests/faults_connections_test).
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  const long soft = limit.rlim_cur == RLIM_INFINITY ? LONG_MAX : static_cast<long>(limit.rlim_cur);
  const long cap = soft == LONG_MAX ? LONG_MAX : soft - std::max<long>(64, soft / 16);
  int spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  uint64_t refused = 0;
  auto logged = std::chrono::steady_clock::time_point();
  auto refuse = [&](int fd) {
    close(fd);
    ++refused;
    const auto now = std::chrono::steady_clock::now();
    if (now - logged > std::chrono::seconds(10)) {
      logged = now;
      Logger("server")->warn(
          "refusing local connections: refitd is near its file-descriptor limit ({}; it keeps "
          "{} for its own work); {} refused so far (raise LimitNOFILE to serve more clients)",
          soft, soft - cap, refused);
    }
  };
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, 200);
    if (ready <= 0) continue;
    // gRPC's endpoints expect non-blocking sockets.
    const int client = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (client < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        if (spare >= 0) {
          close(spare);
          const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
          if (fd >= 0) refuse(fd);
          spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
      continue;
    }
    if (client >= cap) {
      refuse(client);
      continue;
    }
    if (fd_exchange_ && fd_exchange_->Divert(client)) continue;  // memfd passing, or not yet known
    Route(client);
  }
  if (spare >= 0) close(spare);
}

void LocalListener::Route(int fd) {
  auto caller = PeerOf(fd);
  common::MutexLock lock(mu_);
  if (shut_down_) {
    close(fd);
    return;
  }
  const bool allowed = caller.ok() && policy_.Allows(*caller);
  if (!allowed) {
    const uid_t uid = caller.ok() ? caller->uid : static_cast<uid_t>(-1);
    // A refused uid's connections are admitted at a bounded rate (and each lives at most
    // kRefusedConnectionAge), so it can't hold many of refitd's descriptors.
    RefusedBucket& bucket = refused_buckets_[uid];
    const auto now = std::chrono::steady_clock::now();
    const double refill =
        std::chrono::duration<double>(now - bucket.at).count() * kRefusedPerSecond;
    bucket.tokens = std::min(kRefusedBurst, bucket.tokens + refill);
    bucket.at = now;
    if (bucket.tokens < 1) {
      close(fd);
      return;
    }
    bucket.tokens -= 1;
    if (!logged_refusal_[uid]) {
      logged_refusal_[uid] = true;  // once per uid: no log floods
      Logger("server")->warn(
          "local caller {} is not allowed (allowed: {}); it gets "
          "PERMISSION_DENIED",
          caller.ok() ? caller->Describe() : caller.status().ToString(), policy_.Describe());
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
  if (!caller) {
    if (!refused_) refused_ = Build(nullptr, -1);
    return refused_.get();
  }
  // A process of its own when refitd can see its pid and watch it; else its uid's server.
  if (caller->pid != 0) {
    auto it = servers_.find({caller->uid, caller->pid});
    if (it != servers_.end()) return it->second.get();
    size_t processes = 0;
    for (const auto& [key, served] : servers_) processes += key.second != 0;
    if (processes >= kMaxProcessServers) {
      if (!logged_full_) {
        logged_full_ = true;
        Logger("server")->warn(
            "{} local client processes have servers of their own; more share "
            "their uid's server, and their buffers are not released when "
            "they exit (release them with refitctl release)",
            kMaxProcessServers);
      }
    } else if (!TooManyThreads(limits_.max_threads, &logged_threads_)) {
      const int pidfd = OpenPidfd(caller->pid);
      if (pidfd >= 0) {
        std::unique_ptr<Served> served = Build(caller, pidfd);
        if (!served) return nullptr;
        Served* raw = served.get();
        servers_[{caller->uid, caller->pid}] = std::move(served);
        Wake(wake_fd_);  // the exit watcher picks the new pidfd up
        return raw;
      }
    }
  }
  std::unique_ptr<Served>& shared = servers_[{caller->uid, 0}];
  if (!shared) {
    // Built whatever the thread count: one per uid (bounded by the uids the policy allows),
    // each with a thread quota of its own.
    Caller uid_caller = *caller;
    uid_caller.pid = 0;
    shared = Build(&uid_caller, -1);
    if (!shared) {
      servers_.erase({caller->uid, 0});
      return nullptr;
    }
  }
  return shared.get();
}

std::unique_ptr<LocalListener::Served> LocalListener::Build(const Caller* caller, int pidfd) {
  auto served = std::make_unique<Served>();
  served->pidfd = pidfd;
  if (caller) served->caller = *caller;
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // A connection that has not finished its HTTP/2 handshake (settings) by then is closed.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, limits_.handshake_timeout_ms);
  if (!caller) {
    // A refused caller's connection is told goodbye (GOAWAY) after a while.
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(kRefusedConnectionAge.count()));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 1000);
  }
  if (caller) {
    // A quota of this server's own (see the header): its threads can't be taken by another
    // caller's calls, and it is never found empty when the server starts its first thread.
    const bool process = caller->pid != 0;
    served->quota = std::make_unique<grpc::ResourceQuota>(
        absl::StrCat("refit-local-", caller->uid, "-", caller->pid));
    served->quota->SetMaxThreads(process ? limits_.process_threads : limits_.uid_threads);
    served->quota->Resize(process ? limits_.process_memory : limits_.uid_memory);
    builder.SetResourceQuota(*served->quota);
  }
  // A process's server serves one client: one completion queue and one poller to start with
  // (gRPC adds threads for concurrent calls).
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  served->acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      grpc::InsecureServerCredentials());
  served->keep = factory_(caller, &builder);
  served->server = builder.BuildAndStart();
  if (!served->server) {
    return nullptr;  // ~Served closes the pidfd
  }
  return served;
}

size_t LocalListener::ProcessServers() const {
  common::MutexLock lock(mu_);
  size_t processes = 0;
  for (const auto& [key, served] : servers_) processes += key.second != 0;
  return processes;
}

void LocalListener::WatchExits() {
  std::vector<pollfd> fds;
  std::vector<Key> keys;
  while (!stop_.load()) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    keys.assign(1, Key{});
    {
      common::MutexLock lock(mu_);
      for (const auto& [key, served] : servers_) {
        if (served->pidfd < 0) continue;
        fds.push_back(pollfd{served->pidfd, POLLIN, 0});
        keys.push_back(key);
      }
    }
    if (poll(fds.data(), fds.size(), -1) <= 0) continue;
    if (fds[0].revents != 0) {
      uint64_t count = 0;
      (void)!read(wake_fd_, &count, sizeof(count));
    }
    for (size_t i = 1; i < fds.size() && !stop_.load(); ++i) {
      if (fds[i].revents != 0) Retire(keys[i]);  // a pidfd is readable once its process exits
    }
  }
}

void LocalListener::Retire(const Key& key) {
  std::unique_ptr<Served> served;
  {
    common::MutexLock lock(mu_);
    auto it = servers_.find(key);
    if (it == servers_.end() || shut_down_) return;
    served = std::move(it->second);
    servers_.erase(it);
  }
  Logger("server")->debug("local client {} exited", served->caller.Describe());
  if (exits_) exits_->OnClientExit(served->caller);
  // Its connections are gone with it; calls still running on its behalf get a moment.
  served->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

void LocalListener::Shutdown(std::chrono::milliseconds grace) {
  if (stop_.exchange(true)) return;
  Wake(wake_fd_);
  if (accept_thread_.joinable()) accept_thread_.join();
  if (fd_exchange_) fd_exchange_->StopSorting();  // no Route from it after this
  if (exit_thread_.joinable()) exit_thread_.join();
  close(fd_);
  std::vector<Served*> all;
  {
    common::MutexLock lock(mu_);
    shut_down_ = true;
    for (auto& [key, served] : servers_) all.push_back(served.get());
    if (refused_) all.push_back(refused_.get());
  }
  const auto deadline = std::chrono::system_clock::now() + grace;
  for (Served* served : all) served->server->Shutdown(deadline);
  unlink(path_.c_str());
}

}  // namespace refit::callers
