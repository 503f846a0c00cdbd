// Client::PassMemfd: a memfd to refitd over its socket with SCM_RIGHTS (docs/api.md "Sealed
// memfds").

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/refit_client.h"

namespace refit::client {

namespace {

// refitd's fd-passing preface (daemon/callers/fd_exchange.h, docs/api.md "Sealed memfds").
constexpr char kFdPreface[] = "REFITFD1";

absl::StatusCode CodeNamed(const std::string& name) {
  for (int code = 0; code <= 16; ++code) {
    if (absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) == name) {
      return static_cast<absl::StatusCode>(code);
    }
  }
  return absl::StatusCode::kUnknown;
}

}  // namespace

absl::StatusOr<std::string> Client::PassMemfd(int memfd) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  auto fail = [&](const std::string& what) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("passing a memfd to refitd at ", socket_path_, ": ",
                                               what, ": ", std::strerror(err)));
  };
  timeval timeout{};
  timeout.tv_sec = static_cast<time_t>(call_timeout_.count() / 1000);
  timeout.tv_usec = static_cast<suseconds_t>(call_timeout_.count() % 1000 * 1000);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path_.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return fail("connect");
  char preface[sizeof(kFdPreface) - 1];
  std::memcpy(preface, kFdPreface, sizeof(preface));
  iovec iov{preface, sizeof(preface)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &memfd, sizeof(int));
  if (sendmsg(fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(preface))) {
    return fail("sendmsg");
  }
  std::string line;
  char chunk[256];
  while (line.find('\n') == std::string::npos && line.size() < 4096) {
    const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("reading the answer");
    if (n == 0) break;
    line.append(chunk, static_cast<size_t>(n));
  }
  close(fd);
  line = line.substr(0, line.find('\n'));
  if (line.rfind("OK ", 0) == 0) return line.substr(3);
  if (line.rfind("ERR ", 0) == 0) {
    const size_t space = line.find(' ', 4);
    const std::string code = line.substr(4, space == std::string::npos ? space : space - 4);
    return absl::Status(
        CodeNamed(code),
        absl::StrCat("PassMemfd: ", space == std::string::npos ? "" : line.substr(space + 1)));
  }
  return absl::UnavailableError(absl::StrCat("passing a memfd to refitd at ", socket_path_,
                                             ": no answer (is it a refitd older than memfd ",
                                             "passing?) ", line.substr(0, 200)));
}

}  // namespace refit::client
