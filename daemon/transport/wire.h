#pragma once

// The byte formats every backend shares for what crosses the network between daemons: a
// transport's address (Transport::LocalAddress) and a memory descriptor
// (LocalMemory::descriptor). Both are framed the same way so a peer can reject anything
// malformed before a backend (UCX) parses it:
//
//   magic[4] version:u8 backend:u8 issuer:u64 [address:u64 length:u64] payload_len:u32
//   payload[payload_len] checksum:u64
//
// Integers are little-endian; the checksum is FNV-1a 64 over all preceding bytes. `issuer` is
// the random identity of the transport that produced the bytes, so a descriptor imported on an
// endpoint to another peer is refused. For UCX the payload is the worker address or the packed
// rkey; the in-process backend uses an empty address payload and a region id.
//
// Pure functions, safe from any thread. Internal to daemon/transport.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/transport/transport.h"

namespace refit::transport {

enum class WireBackend : uint8_t { kUcx = 1, kInproc = 2 };

struct WireAddress {
  WireBackend backend = WireBackend::kUcx;
  uint64_t issuer = 0;
  std::string payload;
};

struct WireDescriptor {
  WireBackend backend = WireBackend::kUcx;
  uint64_t issuer = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string payload;
};

std::string EncodeAddress(const WireAddress& address);
std::string EncodeDescriptor(const WireDescriptor& descriptor);

// INVALID_ARGUMENT for anything but well-formed bytes of `expected` backend.
absl::StatusOr<WireAddress> DecodeAddress(std::string_view bytes, WireBackend expected);
absl::StatusOr<WireDescriptor> DecodeDescriptor(std::string_view bytes, WireBackend expected);

// A random, process-unique identity for a new transport (never 0).
uint64_t NewTransportIdentity();

// `bytes` random bytes (std::random_device): tokens of grants (Transport::GrantRead).
std::string RandomBytes(size_t bytes);

// INVALID_ARGUMENT unless [local_offset, +length) fits in local_length and
// [remote_offset, +length) fits in remote_length (overflow-safe).
absl::Status CheckRanges(uint64_t local_offset, uint64_t local_length, uint64_t remote_offset,
                         uint64_t remote_length, uint64_t length);

// CheckRanges for every span of a PostGetSpans (INVALID_ARGUMENT also for none); the total
// length of the spans.
absl::StatusOr<uint64_t> CheckSpans(const std::vector<Span>& spans, uint64_t local_length,
                                    uint64_t remote_length);

}  // namespace refit::transport
