#include "daemon/peer/peer_limits.h"

#include <malloc.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace refit::peer {

absl::Status CheckNodeName(std::string_view name, std::string_view what) {
  if (name.empty() || name.size() > kMaxNodeName) {
    return absl::InvalidArgumentError(absl::StrCat("a ", std::string(what), " is 1 to ",
                                                   kMaxNodeName, " bytes (got ", name.size(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckModelName(std::string_view name) {
  if (name.empty() || name.size() > kMaxModelName) {
    return absl::InvalidArgumentError(
        absl::StrCat("a model name is 1 to ", kMaxModelName, " bytes (got ", name.size(), ")"));
  }
  return absl::OkStatus();
}

std::string Printable(std::string_view text, size_t max) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (out.size() >= max) {
      absl::StrAppend(&out, "...(", text.size(), " bytes)");
      break;
    }
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, absl::StrFormat("\\x%02x", c));
    }
  }
  return out;
}

bool SameBytes(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

std::string PeerHost(std::string_view peer) {
  const auto scheme = peer.find(':');
  const auto port = peer.rfind(':');
  if (scheme == std::string_view::npos || port <= scheme) return std::string(peer);
  const std::string_view kind = peer.substr(0, scheme);
  if (kind != "ipv4" && kind != "ipv6") return std::string(peer);
  return std::string(peer.substr(scheme + 1, port - scheme - 1));
}

namespace {
constexpr size_t kLargeRequest = 256 << 10;
std::atomic<int64_t> large_request_at{0};  // steady clock, ms; 0: none since the last trim
std::atomic<int64_t> trimmed_at{0};
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void NoteLargeRequest(size_t bytes) {
  if (bytes >= kLargeRequest) large_request_at.store(NowMs());
}

void TrimAfterLargeRequests() {
  const int64_t seen = large_request_at.load();
  const int64_t now = NowMs();
  // Once the request has been answered and freed (it was seen a while ago), and not often.
  if (seen == 0 || now - seen < 500 || now - trimmed_at.load() < 1000) return;
  int64_t expected = seen;
  if (!large_request_at.compare_exchange_strong(expected, 0)) return;
  trimmed_at.store(now);
  malloc_trim(0);
}

StreamLimiter::StreamLimiter(size_t total, size_t per_source)
    : total_(total), per_source_(per_source) {}

StreamLimiter::Ticket::~Ticket() { limiter_->Leave(source_, id_); }

absl::StatusOr<std::unique_ptr<StreamLimiter::Ticket>> StreamLimiter::Admit(
    const std::string& source, std::string_view what) {
  common::MutexLock lock(mu_);
  std::list<Entry>& mine = sources_[source];
  if (mine.size() >= per_source_) {
    ++refusals_;
    return absl::ResourceExhaustedError(
        absl::StrCat(std::string(what), " refused: ", Printable(source), " holds ", mine.size(),
                     " peer streams here already (at most ", per_source_, " per peer)"));
  }
  if (open_ >= total_) {
    // The largest holder other than the newcomer's source gives up its oldest stream, if it
    // holds more than the newcomer would.
    auto largest = sources_.end();
    for (auto it = sources_.begin(); it != sources_.end(); ++it) {
      if (it->first != source &&
          (largest == sources_.end() || it->second.size() > largest->second.size())) {
        largest = it;
      }
    }
    if (largest == sources_.end() || largest->second.size() <= mine.size() + 1) {
      ++refusals_;
      if (mine.empty()) sources_.erase(source);
      return absl::ResourceExhaustedError(absl::StrCat(std::string(what), " refused: ", open_,
                                                       " peer streams are open here (at most ",
                                                       total_, ")"));
    }
    largest->second.front().evicted->store(true);
    largest->second.pop_front();
    if (largest->second.empty()) sources_.erase(largest);
    --open_;
    ++evictions_;
  }
  const uint64_t id = next_id_++;
  auto evicted = std::make_shared<std::atomic<bool>>(false);
  mine.push_back({id, evicted});
  ++open_;
  return std::unique_ptr<Ticket>(new Ticket(this, source, id, std::move(evicted)));
}

void StreamLimiter::Leave(const std::string& source, uint64_t id) {
  common::MutexLock lock(mu_);
  auto it = sources_.find(source);
  if (it == sources_.end()) return;
  for (auto e = it->second.begin(); e != it->second.end(); ++e) {
    if (e->id == id) {
      it->second.erase(e);
      --open_;
      break;
    }
  }
  if (it->second.empty()) sources_.erase(it);
}

size_t StreamLimiter::open() const {
  common::MutexLock lock(mu_);
  return open_;
}

size_t StreamLimiter::evictions() const {
  common::MutexLock lock(mu_);
  return evictions_;
}

size_t StreamLimiter::refusals() const {
  common::MutexLock lock(mu_);
  return refusals_;
}

}  // namespace refit::peer
