#pragma once

// What the fuzz tests (tests/fuzz_test.cc, tests/peer_fuzz_test.cc) share: random requests from
// one seed, mostly ordinary values and sometimes one at an edge.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "google/protobuf/message.h"
#include "tests/testing/daemon_process.h"

namespace refit::testing {

// The size of the shm objects the fuzzers register (edge values are drawn around it).
inline constexpr uint64_t kShmBytes = 64 << 10;

// $name as a number, or `fallback` ($REFIT_FUZZ_SEED, $REFIT_FUZZ_ROUNDS).
inline uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value ? std::strtoull(value, nullptr, 10) : fallback;
}

// Random choices from one seed: mostly ordinary values, sometimes one at an edge.
class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}

  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool OneIn(uint64_t n) { return Below(n) == 0; }
  template <class T>
  const T& Pick(const std::vector<T>& from) {
    return from[Below(from.size())];
  }

  int64_t Int(int64_t usual) {
    static const int64_t kEdges[] = {0,
                                     -1,
                                     1,
                                     INT64_MAX,
                                     INT64_MIN,
                                     INT32_MAX,
                                     int64_t{1} << 32,
                                     int64_t{1} << 62,
                                     -(int64_t{1} << 40)};
    if (OneIn(5)) return kEdges[Below(std::size(kEdges))];
    return static_cast<int64_t>(Below(static_cast<uint64_t>(usual)));
  }
  uint64_t U64(uint64_t usual) {
    static const uint64_t kEdges[] = {0,          1,          UINT64_MAX, UINT64_MAX - 3,
                                      1ull << 63, 1ull << 32, kShmBytes,  kShmBytes + 1};
    if (OneIn(5)) return kEdges[Below(std::size(kEdges))];
    return Below(usual);
  }
  std::string Text() {
    static const std::vector<std::string> kTexts = {"",
                                                    "m",
                                                    "w",
                                                    "v",
                                                    "x",
                                                    "a b/c",
                                                    "model.layers.0.self_attn.q_proj.weight",
                                                    "\xc3\xa9t\xc3\xa9",
                                                    std::string(5000, 'a'),
                                                    "%s%s%n",
                                                    "../../etc/passwd"};
    if (OneIn(3)) {
      std::string s(Below(20), ' ');
      for (char& c : s) c = static_cast<char>(' ' + Below(95));
      return s;
    }
    return Pick(kTexts);
  }

  // Slices that register: "w" [32, 32] fp32 whole or in row halves, "v" [64] bf16.
  v1::TensorSlice SaneSlice(uint64_t buffer_offset) {
    switch (Below(4)) {
      case 0:
        return client::Slice("w", v1::FP32, {32, 32}, buffer_offset);
      case 1:
        return client::Slice("w", v1::FP32, {32, 32}, buffer_offset, {0, 0}, {16, 32});
      case 2:
        return client::Slice("w", v1::FP32, {32, 32}, buffer_offset, {16, 0}, {16, 32});
      default:
        return client::Slice("v", v1::BF16, {64}, buffer_offset);
    }
  }

  void MutateSlice(v1::TensorSlice* s) {
    auto dims = [&](google::protobuf::RepeatedField<int64_t>* f) {
      if (OneIn(3)) {
        f->Clear();
        for (uint64_t n = OneIn(10) ? 40 : Below(4); n > 0; --n) f->Add(Int(40));
      } else if (!f->empty()) {
        f->Set(static_cast<int>(Below(f->size())), Int(40));
      }
    };
    switch (Below(7)) {
      case 0:
        s->set_name(Text());
        break;
      case 1:
        s->set_dtype(static_cast<v1::DType>(OneIn(4) ? Int(100) : Below(12)));
        break;
      case 2:
        dims(s->mutable_global_shape());
        break;
      case 3:
        dims(s->mutable_offsets());
        break;
      case 4:
        dims(s->mutable_sizes());
        break;
      case 5:
        s->set_buffer_offset(U64(kShmBytes));
        break;
      default:
        dims(s->mutable_buffer_strides());
    }
  }

 private:
  std::mt19937_64 rng_;
};

// A request for a failure message, cut at 2,000 characters.
inline std::string Describe(const google::protobuf::Message& message) {
  std::string text = message.ShortDebugString();
  if (text.size() > 2000) text = text.substr(0, 2000) + "...";
  return text;
}

// Prints how often each status code came back (a test's WARN line).
inline void PrintCodes(const char* what, uint64_t seed, const std::map<int, int>& codes) {
  std::string line;
  for (const auto& [code, count] : codes) {
    line += " code" + std::to_string(code) + "=" + std::to_string(count);
  }
  WARN(what << " seed " << seed << ":" << line);
}

// The daemon still does its job: model "after" is published from `src` and applied into `dst`
// (8 KiB in) bit-exactly.
inline void ExpectStillServing(DaemonProcess& daemon, client::SharedMemory& src,
                               client::SharedMemory& dst) {
  REQUIRE(daemon.running());
  auto c = daemon.Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  // Windows of their own ([0, 4 KiB) and [8 KiB, 12 KiB)): the whole objects may still be
  // registered by the requests before, and one memory is one buffer.
  auto sid = client.RegisterBuffer("after", v1::SOURCE, src.name(),
                                   {client::Slice("w", v1::FP32, {32, 32})}, "", 0, 4096);
  auto did = client.RegisterBuffer("after", v1::DESTINATION, dst.name(),
                                   {client::Slice("w", v1::FP32, {32, 32})}, "", 8192, 4096);
  REQUIRE(sid.ok());
  REQUIRE(did.ok());
  REQUIRE(client.Publish("after", 1, {*sid}).ok());
  auto applied = client.Apply("after", 0, {*did});
  REQUIRE(applied.ok());
  CHECK(applied->version() == 1);
  CHECK(std::memcmp(src.data(), dst.data() + 8192, 4096) == 0);
}

}  // namespace refit::testing
