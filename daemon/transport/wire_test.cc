#include "daemon/transport/wire.h"

#include <set>

#include "catch2/catch.hpp"

namespace refit::transport {
namespace {

TEST_CASE("addresses and descriptors round-trip", "[transport][wire]") {
  WireAddress a{WireBackend::kUcx, 42, std::string("\x00\x01worker\xff", 9)};
  auto a2 = DecodeAddress(EncodeAddress(a), WireBackend::kUcx);
  REQUIRE(a2.ok());
  CHECK(a2->issuer == 42);
  CHECK(a2->payload == a.payload);

  WireDescriptor d{WireBackend::kInproc, 7, 0x7f0000001000, 4096, "rkey"};
  auto d2 = DecodeDescriptor(EncodeDescriptor(d), WireBackend::kInproc);
  REQUIRE(d2.ok());
  CHECK(d2->issuer == 7);
  CHECK(d2->address == d.address);
  CHECK(d2->length == 4096);
  CHECK(d2->payload == "rkey");
}

TEST_CASE("every truncation and every flipped bit is rejected", "[transport][wire]") {
  const std::string bytes =
      EncodeDescriptor({WireBackend::kUcx, 99, 0x1000, 1 << 20, std::string(40, 'k')});
  for (size_t n = 0; n < bytes.size(); ++n) {
    CHECK(DecodeDescriptor(bytes.substr(0, n), WireBackend::kUcx).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      INFO("byte " << i << " bit " << bit);
      CHECK(DecodeDescriptor(bad, WireBackend::kUcx).status().code() ==
            absl::StatusCode::kInvalidArgument);
    }
  }
  CHECK_FALSE(DecodeDescriptor(bytes + '\0', WireBackend::kUcx).ok());
}

TEST_CASE("another release's protocol version is refused with a message saying so",
          "[transport][wire]") {
  std::string bytes = EncodeAddress({WireBackend::kUcx, 5, "worker"});
  REQUIRE(DecodeAddress(bytes, WireBackend::kUcx).ok());
  CHECK(static_cast<int>(bytes[4]) == 2);  // the gathers' version
  bytes[4] = 1;                            // a release before gathers
  const absl::Status s = DecodeAddress(bytes, WireBackend::kUcx).status();
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("protocol version 1") != std::string::npos);
  CHECK(s.message().find("same refit release") != std::string::npos);
}

TEST_CASE("the wrong backend, kind or an impossible range is rejected", "[transport][wire]") {
  const std::string address = EncodeAddress({WireBackend::kInproc, 5, ""});
  CHECK_FALSE(DecodeAddress(address, WireBackend::kUcx).ok());
  CHECK(DecodeAddress(address, WireBackend::kInproc).ok());
  CHECK_FALSE(DecodeDescriptor(address, WireBackend::kInproc).ok());
  CHECK_FALSE(DecodeDescriptor(EncodeDescriptor({WireBackend::kUcx, 5, ~0ull - 10, 100, "k"}),
                               WireBackend::kUcx)
                  .ok());
  CHECK_FALSE(
      DecodeDescriptor(EncodeDescriptor({WireBackend::kUcx, 5, 4096, 0, "k"}), WireBackend::kUcx)
          .ok());
  CHECK_FALSE(DecodeAddress(EncodeAddress({WireBackend::kUcx, 0, "x"}), WireBackend::kUcx).ok());
}

TEST_CASE("identities are distinct and non-zero", "[transport][wire]") {
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    uint64_t id = NewTransportIdentity();
    CHECK(id != 0);
    seen.insert(id);
  }
  CHECK(seen.size() == 1000);
}

TEST_CASE("CheckRanges is overflow-safe", "[transport][wire]") {
  const uint64_t kMax = ~uint64_t{0};
  CHECK(CheckRanges(0, 100, 0, 100, 100).ok());
  CHECK(CheckRanges(100, 100, 100, 100, 0).ok());
  CHECK_FALSE(CheckRanges(1, 100, 0, 100, 100).ok());
  CHECK_FALSE(CheckRanges(0, 100, 1, 100, 100).ok());
  CHECK_FALSE(CheckRanges(101, 100, 0, 100, 0).ok());
  CHECK_FALSE(CheckRanges(kMax, 100, 0, 100, 2).ok());
  CHECK_FALSE(CheckRanges(0, 100, 50, 100, kMax).ok());
}

}  // namespace
}  // namespace refit::transport
