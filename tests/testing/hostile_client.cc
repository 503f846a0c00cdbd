// What a careless or malicious local process can do to refitd's Unix socket, as one command
// (tests/hostile_local_test, scripts/bench/bench-hostile.sh). Prints one line, "OK k=v ...", then,
// for the operations that hold something, keeps it until its standard input closes.
//
// SOCKET is refitd's Unix socket, or HOST:PORT for hold against a TCP port (--health-listen).
//
//   hostile_client SOCKET hold KIND N [PROCS]
//       PROCS processes (default 1), each opening N long-lived calls of KIND on one channel:
//       health-watch | watch | wait-for-version | wait-for-replicas. After 2 s prints
//       "OK open=<still open> exhausted=<RESOURCE_EXHAUSTED> denied=<PERMISSION_DENIED>
//       other=<any other end>", summed over the processes.
//   hostile_client SOCKET probe N [DEADLINE_MS]
//       N ordinary calls (Status), each on a new connection, one after the other; prints
//       "OK served=<answered OK> failed=<not> first_error=<code>".
//   hostile_client SOCKET stall N [BYTES]
//       N connections that each send BYTES bytes of the HTTP/2 preface (default 1) and stall;
//       prints "OK connected=<N that connected> closed_after_ms=<median time until refitd
//       closed them, or -1>" once they are closed or after 20 s.
//   hostile_client SOCKET fd-preface N
//       N connections that each send refit's fd-passing preface ("REFITFD1") one byte per
//       message, 4 memfds attached to each, and stop one byte short; prints
//       "OK connections=<N> fds_sent=<fds that went out> answered=<refitd's first answer
//       line, or none>".

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/refit/v1/refit.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace health = grpc::health::v1;
namespace v1 = refit::v1;

void WaitForStdinEof() {
  char byte;
  while (read(0, &byte, 1) > 0) {
  }
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& socket) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  args.SetMaxReceiveMessageSize(64 << 20);
  // A path is refitd's Unix socket; HOST:PORT a TCP port (--health-listen).
  const std::string target = socket.rfind('/', 0) == 0 ? "unix:" + socket : socket;
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// One long-lived call; its end (if it ends) arrives on the completion queue as `this`.
struct Call {
  grpc::ClientContext context;
  grpc::Status status;
  health::HealthCheckResponse health_response;
  v1::WaitForVersionResponse version_response;
  v1::WaitForReplicasResponse replicas_response;
  std::unique_ptr<grpc::ClientAsyncReader<health::HealthCheckResponse>> health_reader;
  std::unique_ptr<grpc::ClientAsyncReader<v1::VersionEvent>> watch_reader;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::WaitForVersionResponse>> version_reader;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::WaitForReplicasResponse>> replicas_reader;
  bool done = false;
};

// Opens `n` calls of `kind`; returns "open=.. exhausted=.. denied=.. other=.." after 2 s and
// keeps them open until stdin closes.
std::map<std::string, int> HoldCalls(const std::string& socket, const std::string& kind, int n,
                                     std::vector<std::unique_ptr<Call>>* calls,
                                     grpc::CompletionQueue* cq) {
  auto channel = NewChannel(socket);
  channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto health_stub = health::Health::NewStub(channel);
  auto refit_stub = v1::Refit::NewStub(channel);
  for (int i = 0; i < n; ++i) {
    auto call = std::make_unique<Call>();
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
    void* tag = call.get();
    if (kind == "health-watch") {
      health::HealthCheckRequest request;
      call->health_reader = health_stub->PrepareAsyncWatch(&call->context, request, cq);
      call->health_reader->StartCall(nullptr);
      call->health_reader->Finish(&call->status, tag);
    } else if (kind == "watch") {
      v1::WatchRequest request;
      request.set_model("hostile-watch");
      request.set_after_version(1);
      call->watch_reader = refit_stub->PrepareAsyncWatch(&call->context, request, cq);
      call->watch_reader->StartCall(nullptr);
      call->watch_reader->Finish(&call->status, tag);
    } else if (kind == "wait-for-version") {
      v1::WaitForVersionRequest request;
      request.set_model("hostile-wait");
      request.set_min_version(1);
      call->version_reader = refit_stub->PrepareAsyncWaitForVersion(&call->context, request, cq);
      call->version_reader->StartCall();
      call->version_reader->Finish(&call->version_response, &call->status, tag);
    } else if (kind == "wait-for-replicas") {
      v1::WaitForReplicasRequest request;
      request.set_model("hostile-replicas");
      request.set_version(1);
      request.set_min_nodes(1000);
      call->replicas_reader = refit_stub->PrepareAsyncWaitForReplicas(&call->context, request, cq);
      call->replicas_reader->StartCall();
      call->replicas_reader->Finish(&call->replicas_response, &call->status, tag);
    } else {
      std::cerr << "hostile_client: unknown kind " << kind << "\n";
      std::exit(2);
    }
    calls->push_back(std::move(call));
  }
  std::map<std::string, int> counts = {{"open", 0}, {"exhausted", 0}, {"denied", 0}, {"other", 0}};
  const auto settle = std::chrono::system_clock::now() + std::chrono::seconds(2);
  while (true) {
    void* tag = nullptr;
    bool ok = false;
    const auto next = cq->AsyncNext(&tag, &ok, settle);
    if (next != grpc::CompletionQueue::GOT_EVENT) break;
    if (tag) static_cast<Call*>(tag)->done = true;  // StartCall's tags are null
  }
  for (const auto& call : *calls) {
    if (!call->done) {
      ++counts["open"];
    } else if (call->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++counts["exhausted"];
    } else if (call->status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      ++counts["denied"];
    } else {
      ++counts["other"];
      if (counts["other"] == 1) {
        std::cerr << "hostile_client: a call ended " << call->status.error_code() << " "
                  << call->status.error_message() << "\n";
      }
    }
  }
  return counts;
}

std::string Line(const std::map<std::string, int>& counts) {
  std::string line = "OK";
  for (const char* key : {"open", "exhausted", "denied", "other"}) {
    line += " " + std::string(key) + "=" + std::to_string(counts.at(key));
  }
  return line;
}

int Hold(const std::string& socket, const std::string& kind, int n, int procs) {
  std::vector<pid_t> children;
  std::vector<int> pipes;
  for (int p = 0; p < procs; ++p) {
    int fds[2];
    if (pipe(fds) != 0) return 1;
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(fds[0]);
      grpc::CompletionQueue cq;
      std::vector<std::unique_ptr<Call>> calls;
      const std::string line = Line(HoldCalls(socket, kind, n, &calls, &cq)) + "\n";
      (void)!write(fds[1], line.data(), line.size());
      close(fds[1]);
      WaitForStdinEof();
      for (auto& call : calls) call->context.TryCancel();
      _exit(0);  // no orderly gRPC shutdown: the calls die with the process
    }
    close(fds[1]);
    children.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::map<std::string, int> total = {{"open", 0}, {"exhausted", 0}, {"denied", 0}, {"other", 0}};
  for (int fd : pipes) {
    std::string text;
    char buffer[256];
    ssize_t got;
    while ((got = read(fd, buffer, sizeof(buffer))) > 0) text.append(buffer, got);
    close(fd);
    for (auto& [key, value] : total) {
      const auto at = text.find(" " + key + "=");
      if (at != std::string::npos) value += std::atoi(text.c_str() + at + key.size() + 2);
    }
  }
  std::cout << Line(total) << std::endl;
  WaitForStdinEof();
  for (pid_t pid : children) kill(pid, SIGKILL);
  for (pid_t pid : children) waitpid(pid, nullptr, 0);
  return 0;
}

int Probe(const std::string& socket, int n, int deadline_ms) {
  int served = 0, failed = 0;
  std::string first_error = "none";
  for (int i = 0; i < n; ++i) {
    auto stub = v1::Refit::NewStub(NewChannel(socket));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    context.set_wait_for_ready(true);
    v1::StatusRequest request;
    v1::StatusResponse response;
    const grpc::Status status = stub->Status(&context, request, &response);
    if (status.ok()) {
      ++served;
    } else {
      ++failed;
      if (first_error == "none") first_error = std::to_string(status.error_code());
    }
  }
  std::cout << "OK served=" << served << " failed=" << failed << " first_error=" << first_error
            << std::endl;
  return 0;
}

int Connect(const std::string& socket) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int Stall(const std::string& socket, int n, int bytes) {
  static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = Connect(socket);
    if (fd < 0) continue;
    (void)!send(fd, kPreface, std::min<size_t>(bytes, sizeof(kPreface) - 1), MSG_NOSIGNAL);
    fds.push_back(fd);
  }
  const auto start = Clock::now();
  std::vector<long> closed_after;
  std::vector<bool> closed(fds.size(), false);
  while (closed_after.size() < fds.size() && Clock::now() - start < std::chrono::seconds(20)) {
    std::vector<pollfd> polled;
    for (int fd : fds) polled.push_back(pollfd{fd, POLLIN, 0});
    poll(polled.data(), polled.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (closed[i] || !(polled[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      const ssize_t got = recv(fds[i], buffer, sizeof(buffer), MSG_DONTWAIT);
      if (got > 0) continue;  // refitd's settings: gRPC answered; still open
      closed[i] = true;
      closed_after.push_back(
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count());
    }
  }
  std::sort(closed_after.begin(), closed_after.end());
  const long median = closed_after.size() == fds.size() && !fds.empty()
                          ? closed_after[closed_after.size() / 2]
                          : -1;
  std::cout << "OK connected=" << fds.size() << " closed=" << closed_after.size()
            << " closed_after_ms=" << median << std::endl;
  for (int fd : fds) close(fd);
  return 0;
}

int FdPreface(const std::string& socket, int n) {
  static const char kFdPreface[] = "REFITFD1";
  std::vector<int> conns;
  int sent = 0;
  std::string answered = "none";
  for (int i = 0; i < n; ++i) {
    const int fd = Connect(socket);
    if (fd < 0) continue;
    conns.push_back(fd);
    for (int b = 0; b < 7; ++b) {  // one byte short of the preface
      int memfds[4];
      for (int& m : memfds) m = memfd_create("hostile", MFD_CLOEXEC);
      iovec iov{const_cast<char*>(kFdPreface + b), 1};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(memfds))];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(memfds));
      std::memcpy(CMSG_DATA(c), memfds, sizeof(memfds));
      if (sendmsg(fd, &msg, MSG_NOSIGNAL) == 1) sent += 4;
      for (int m : memfds) close(m);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (int fd : conns) {
    char line[256];
    const ssize_t got = recv(fd, line, sizeof(line) - 1, MSG_DONTWAIT);
    if (got > 0 && answered == "none") {
      line[got] = 0;
      answered = std::string(line, strcspn(line, "\n"));
      for (char& ch : answered) ch = ch == ' ' ? '_' : ch;
    }
  }
  std::cout << "OK connections=" << conns.size() << " fds_sent=" << sent << " answered=" << answered
            << std::endl;
  WaitForStdinEof();
  for (int fd : conns) close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc < 4) {
    std::cerr << "usage: hostile_client SOCKET OP ARGS...\n";
    return 2;
  }
  const std::string socket = argv[1], op = argv[2];
  const int n = std::atoi(argv[3]);
  if (op == "hold" && argc >= 5) {
    return Hold(socket, argv[3], std::atoi(argv[4]), argc >= 6 ? std::atoi(argv[5]) : 1);
  }
  if (op == "probe") return Probe(socket, n, argc >= 5 ? std::atoi(argv[4]) : 2000);
  if (op == "stall") return Stall(socket, n, argc >= 5 ? std::atoi(argv[4]) : 1);
  if (op == "fd-preface") return FdPreface(socket, n);
  std::cerr << "hostile_client: unknown operation " << op << "\n";
  return 2;
}
