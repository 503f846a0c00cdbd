#pragma once

// Internal to daemon/delta: LEB128 varints, zigzag coding of bit-pattern differences and
// little-endian fixed-width fields, with bounds-checked readers for untrusted input.
// Pure functions; thread-safe.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace refit::delta::internal {

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "daemon/delta assumes a little-endian host (the delta format is little-endian)"
#endif

inline constexpr size_t kMaxVarintBytes = 10;

// Writes `value` as a varint at `out` (room for kMaxVarintBytes); returns the bytes written.
inline size_t EncodeVarint(uint8_t* out, uint64_t value) {
  size_t size = 0;
  while (value >= 0x80) {
    out[size++] = static_cast<uint8_t>(value | 0x80);
    value >>= 7;
  }
  out[size++] = static_cast<uint8_t>(value);
  return size;
}

inline void PutVarint(std::vector<uint8_t>& out, uint64_t value) {
  uint8_t bytes[kMaxVarintBytes];
  out.insert(out.end(), bytes, bytes + EncodeVarint(bytes, value));
}

// Reads a varint from [*cursor, end) and advances *cursor. False (cursor unspecified) when the
// input ends inside the varint, it is longer than 10 bytes or it overflows 64 bits.
inline bool GetVarint(const uint8_t*& cursor, const uint8_t* end, uint64_t& value) {
  uint64_t result = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (cursor == end) return false;
    const uint8_t byte = *cursor++;
    if (shift == 63 && byte > 1) return false;
    result |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) {
      value = result;
      return true;
    }
  }
  return false;
}

template <typename T>
inline void StoreFixed(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

template <typename T>
inline T LoadFixed(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

// Zigzag of `target - base` read as a signed number of T's width: 0, -1, 1, -2, ... map to
// 0, 1, 2, 3, ..., so a one-ulp move costs one small symbol whichever way it goes.
template <typename T>
inline uint64_t ZigZagDiff(T base, T target) {
  static_assert(std::is_unsigned_v<T>);
  using S = std::make_signed_t<T>;
  const T diff = static_cast<T>(target - base);
  const S s = static_cast<S>(diff);
  return static_cast<T>(static_cast<T>(diff << 1) ^ static_cast<T>(s >> (sizeof(T) * 8 - 1)));
}

// The inverse: the amount to add to base (modulo 2^width) to reach target.
template <typename T>
inline T UnZigZag(uint64_t zigzag) {
  return static_cast<T>((zigzag >> 1) ^ (0 - (zigzag & 1)));
}

}  // namespace refit::delta::internal
