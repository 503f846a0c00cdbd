#include "daemon/transport/wire.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace refit::transport {
namespace {

constexpr char kAddressMagic[4] = {'R', 'F', 'T', 'A'};
constexpr char kDescriptorMagic[4] = {'R', 'F', 'T', 'M'};
// 2: the UCX backend's gathers (ucx_gather.cc). A peer speaking another version is refused at
// Connect/ImportRemote, so that a cluster of mixed releases fails at once rather than waiting
// on requests the other side doesn't know.
constexpr uint8_t kVersion = 2;
// A payload is a UCX worker address or packed rkey: a few hundred bytes, never megabytes.
constexpr uint32_t kMaxPayload = 1 << 20;

uint64_t Fnv1a(std::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

void PutU8(std::string* out, uint8_t v) { out->push_back(static_cast<char>(v)); }
void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads the framed fields in order; any short read turns the reader bad.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  bool ok() const { return ok_; }
  size_t position() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }

  std::string_view Bytes(size_t n) {
    if (!ok_ || remaining() < n) {
      ok_ = false;
      return {};
    }
    std::string_view out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t UInt(int width) {
    std::string_view b = Bytes(width);
    uint64_t v = 0;
    for (int i = 0; ok_ && i < width; ++i)
      v |= uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
    return v;
  }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
  bool ok_ = true;
};

std::string Frame(const char (&magic)[4], WireBackend backend, uint64_t issuer,
                  const uint64_t* address, const uint64_t* length, const std::string& payload) {
  std::string out(magic, 4);
  PutU8(&out, kVersion);
  PutU8(&out, static_cast<uint8_t>(backend));
  PutU64(&out, issuer);
  if (address != nullptr) PutU64(&out, *address);
  if (length != nullptr) PutU64(&out, *length);
  PutU32(&out, static_cast<uint32_t>(payload.size()));
  out += payload;
  PutU64(&out, Fnv1a(out));
  return out;
}

// Parses the frame; `address`/`length` non-null when the frame has those fields.
absl::Status Unframe(std::string_view bytes, const char (&magic)[4], const char* what,
                     WireBackend expected, uint64_t* issuer, uint64_t* address, uint64_t* length,
                     std::string* payload) {
  auto invalid = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("malformed transport ", what, " (", bytes.size(),
                                                   " bytes): ", std::string(why)));
  };
  Reader r(bytes);
  if (r.Bytes(4) != std::string_view(magic, 4)) return invalid("bad magic");
  uint64_t version = r.UInt(1);
  if (!r.ok()) return invalid("truncated");
  if (version != kVersion) {
    return invalid(absl::StrCat("data-plane protocol version ", version, ", this refitd speaks ",
                                static_cast<int>(kVersion),
                                " (run the same refit release on every node)"));
  }
  uint64_t backend = r.UInt(1);
  if (!r.ok()) return invalid("truncated");
  if (backend != static_cast<uint8_t>(expected)) {
    return invalid(absl::StrCat("issued by backend ", backend, ", this is backend ",
                                static_cast<int>(expected)));
  }
  *issuer = r.UInt(8);
  if (address != nullptr) *address = r.UInt(8);
  if (length != nullptr) *length = r.UInt(8);
  uint64_t payload_len = r.UInt(4);
  if (!r.ok()) return invalid("truncated header");
  if (payload_len > kMaxPayload) return invalid(absl::StrCat("payload of ", payload_len, " bytes"));
  std::string_view body = r.Bytes(payload_len);
  size_t checked = r.position();
  uint64_t checksum = r.UInt(8);
  if (!r.ok()) return invalid("truncated payload");
  if (r.remaining() != 0) return invalid(absl::StrCat(r.remaining(), " trailing bytes"));
  if (checksum != Fnv1a(bytes.substr(0, checked))) return invalid("checksum mismatch");
  if (*issuer == 0) return invalid("no issuer");
  payload->assign(body.data(), body.size());
  return absl::OkStatus();
}

}  // namespace

std::string EncodeAddress(const WireAddress& a) {
  return Frame(kAddressMagic, a.backend, a.issuer, nullptr, nullptr, a.payload);
}

std::string EncodeDescriptor(const WireDescriptor& d) {
  return Frame(kDescriptorMagic, d.backend, d.issuer, &d.address, &d.length, d.payload);
}

absl::StatusOr<WireAddress> DecodeAddress(std::string_view bytes, WireBackend expected) {
  WireAddress out;
  out.backend = expected;
  absl::Status s = Unframe(bytes, kAddressMagic, "address", expected, &out.issuer, nullptr, nullptr,
                           &out.payload);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<WireDescriptor> DecodeDescriptor(std::string_view bytes, WireBackend expected) {
  WireDescriptor out;
  out.backend = expected;
  absl::Status s = Unframe(bytes, kDescriptorMagic, "memory descriptor", expected, &out.issuer,
                           &out.address, &out.length, &out.payload);
  if (!s.ok()) return s;
  if (out.length == 0 || out.address + out.length < out.address) {
    return absl::InvalidArgumentError(absl::StrCat("memory descriptor with an impossible range [",
                                                   out.address, ", +", out.length, ")"));
  }
  return out;
}

uint64_t NewTransportIdentity() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  v ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  v ^= uint64_t{static_cast<uint32_t>(getpid())} << 17;
  v += 0x9e3779b97f4a7c15ull * (counter.fetch_add(1) + 1);
  // splitmix64 finalizer so that nearby inputs give unrelated identities.
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  v ^= v >> 31;
  return v == 0 ? 1 : v;
}

std::string RandomBytes(size_t bytes) {
  std::random_device rd;  // the kernel's getrandom: unguessable
  std::string out(bytes, '\0');
  for (size_t i = 0; i < bytes; i += 4) {
    const uint32_t word = rd();
    std::memcpy(&out[i], &word, std::min<size_t>(4, bytes - i));
  }
  return out;
}

absl::Status CheckRanges(uint64_t local_offset, uint64_t local_length, uint64_t remote_offset,
                         uint64_t remote_length, uint64_t length) {
  if (local_offset > local_length || length > local_length - local_offset) {
    return absl::InvalidArgumentError(absl::StrCat("local range [", local_offset, ", +", length,
                                                   ") exceeds the registered ", local_length,
                                                   " bytes"));
  }
  if (remote_offset > remote_length || length > remote_length - remote_offset) {
    return absl::InvalidArgumentError(absl::StrCat("remote range [", remote_offset, ", +", length,
                                                   ") exceeds the remote ", remote_length,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckSpans(const std::vector<Span>& spans, uint64_t local_length,
                                    uint64_t remote_length) {
  if (spans.empty()) return absl::InvalidArgumentError("PostGetSpans needs at least one span");
  uint64_t total = 0;
  for (const Span& s : spans) {
    absl::Status fits =
        CheckRanges(s.local_offset, local_length, s.remote_offset, remote_length, s.length);
    if (!fits.ok()) return fits;
    total += s.length;
  }
  return total;
}

}  // namespace refit::transport
