#include "tests/testing/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

namespace refit::testing {
namespace {

// One bind to port 0 on 127.0.0.1; the port the kernel chose, or -1.
int BindAnyPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace

int FreePort() {
  static std::mutex mu;
  static std::set<int>* handed_out = new std::set<int>();
  std::lock_guard<std::mutex> lock(mu);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = BindAnyPort();
    if (port > 0 && handed_out->insert(port).second) return port;
  }
  std::fprintf(stderr, "FreePort: no fresh TCP port on 127.0.0.1 after 1000 binds\n");
  std::abort();
}

}  // namespace refit::testing
