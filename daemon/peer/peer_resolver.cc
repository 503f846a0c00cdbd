#include "daemon/peer/peer_resolver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <set>

namespace refit::peer {

std::vector<std::string> ResolvePeerAddress(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return {address};
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &result) != 0 || !result) {
    return {address};
  }
  std::set<std::string> out;
  for (addrinfo* a = result; a; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.insert(std::string(ip) + ":" + port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
      out.insert("[" + std::string(ip) + "]:" + port);
    }
  }
  freeaddrinfo(result);
  if (out.empty()) return {address};
  return {out.begin(), out.end()};
}

void PeerResolver::Start() {
  ResolveAll();
  thread_ = std::thread([this] { Run(); });
}

void PeerResolver::Stop() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void PeerResolver::ResolveAll() {
  for (const std::string& configured : configured_) {
    auto addresses = ResolvePeerAddress(configured);
    {
      common::MutexLock lock(mu_);
      if (stop_) return;
    }
    for (const std::string& address : addresses) links_->Add(address);
  }
}

void PeerResolver::Run() {
  while (true) {
    {
      common::UniqueLock lock(mu_);
      wake_.WaitFor(lock, every_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
      if (stop_) return;
    }
    ResolveAll();
  }
}

}  // namespace refit::peer
