#pragma once

// Internal to daemon/delta: Rice codes in an LSB-first bit stream, the entropy coder of sparse
// chunks (FORMAT.md, "Rice codes"). A value v with parameter k is written as q = v >> k one-bits,
// a zero-bit and the k low bits of v; when q >= kRiceMaxUnary it is written as kRiceMaxUnary
// one-bits, 7 bits holding L = bit length of v (1..64), then the L bits of v (the escape).
// Rice codes are within a few % of the entropy of geometric data like the gaps between changed
// elements, need no tables, and cost a handful of instructions per value each way.
//
// Thread-safety: a RiceReader is used by one thread; the functions are thread-compatible.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/base/attributes.h"
#include "daemon/delta/varint.h"

namespace refit::delta::internal {

inline constexpr unsigned kRiceMaxUnary = 32;
inline constexpr unsigned kRiceMaxK = 56;
// The longest code: kRiceMaxUnary ones, 7 length bits, 64 value bits.
inline constexpr unsigned kRiceMaxBits = kRiceMaxUnary + 7 + 64;
// A RiceReader may look this many bytes past the end of its stream; callers pad with zeros.
inline constexpr size_t kRicePadding = 32;

inline unsigned BitLength(uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }

// Bits the code of `v` takes with parameter `k`.
inline uint64_t RiceBits(uint64_t v, unsigned k) {
  const uint64_t q = v >> k;
  return q < kRiceMaxUnary ? q + 1 + k : kRiceMaxUnary + 7 + BitLength(v);
}

// Exact bits of `values[0, n)` for the four parameters k_first .. k_first + 3, in one pass.
// The common case (no escape for any of the four) costs a few constant shifts and adds.
inline void RiceBits4(const uint64_t* values, uint64_t n, unsigned k_first, uint64_t (&bits)[4]) {
  uint64_t q_sum[4] = {0, 0, 0, 0};    // sums of the unary parts, when not escaped
  uint64_t escaped[4] = {0, 0, 0, 0};  // bits of escaped codes, all included
  uint64_t plain[4] = {0, 0, 0, 0};    // codes not escaped
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  uint64_t slow = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t q0 = values[i] >> k_first;
    if (q0 < kRiceMaxUnary) {
      s0 += q0;
      s1 += q0 >> 1;
      s2 += q0 >> 2;
      s3 += q0 >> 3;
      continue;
    }
    ++slow;
    for (unsigned c = 0; c < 4; ++c) {
      const uint64_t q = q0 >> c;
      if (q < kRiceMaxUnary) {
        q_sum[c] += q;
        ++plain[c];
      } else {
        escaped[c] += kRiceMaxUnary + 7 + BitLength(values[i]);
      }
    }
  }
  const uint64_t fast = n - slow;
  const uint64_t sums[4] = {s0, s1, s2, s3};
  for (unsigned c = 0; c < 4; ++c) {
    bits[c] = sums[c] + q_sum[c] + (fast + plain[c]) * (1 + k_first + c) + escaped[c];
  }
}

// The Rice parameter in [0, max_k] (max_k >= 3) that codes values[0, n) in the fewest bits, and
// that many bits. Evaluates four parameters per pass, starting at `k_guess` - 2, and slides the
// window while the best one sits on its edge (the total is unimodal in k for the data seen
// here; any k gives a valid code), so one pass is the usual cost.
inline unsigned ChooseRiceK(const uint64_t* values, uint64_t n, unsigned k_guess, unsigned max_k,
                            uint64_t& best_bits) {
  unsigned first = std::min(k_guess < 2 ? 0 : k_guess - 2, max_k - 3);
  int direction = 0;  // fixed by the first pass, so the window never slides back
  while (true) {
    uint64_t bits[4];
    RiceBits4(values, n, first, bits);
    unsigned best = 0;
    for (unsigned c = 1; c < 4; ++c) {
      if (bits[c] < bits[best]) best = c;
    }
    best_bits = bits[best];
    if (best == 3 && first + 3 < max_k && direction >= 0) {
      direction = 1;
      first = std::min(first + 3, max_k - 3);
    } else if (best == 0 && first > 0 && direction <= 0) {
      direction = -1;
      first = first < 3 ? 0 : first - 3;
    } else {
      return first + best;
    }
  }
}

// ChooseRiceK on at most kRiceSample evenly strided values (copied into `sample`), so that the
// choice costs the same for 100 or 10^6 changes, starting from log2 of their mean (a window
// far below the optimum would see only escapes, which cost the same for every k there).
// `estimated_bits` is scaled up to all n values.
inline constexpr uint64_t kRiceSample = 2048;
inline unsigned ChooseRiceKSampled(const uint64_t* values, uint64_t n, unsigned max_k,
                                   std::vector<uint64_t>& sample, uint64_t& estimated_bits) {
  if (n == 0) {
    estimated_bits = 0;
    return 0;
  }
  const uint64_t stride = n <= kRiceSample ? 1 : n / kRiceSample;
  const uint64_t count = n <= kRiceSample ? n : kRiceSample;
  sample.resize(count);
  double sum = 0;
  for (uint64_t i = 0; i < count; ++i) {
    sample[i] = values[i * stride];
    sum += static_cast<double>(sample[i]);
  }
  const double mean = sum / static_cast<double>(count);
  const unsigned k_guess = mean < 1 ? 0 : static_cast<unsigned>(std::log2(mean));
  uint64_t sample_bits = 0;
  const unsigned k =
      ChooseRiceK(sample.data(), count, std::min(k_guess, max_k), max_k, sample_bits);
  estimated_bits = static_cast<uint64_t>(static_cast<double>(sample_bits) * static_cast<double>(n) /
                                         static_cast<double>(count));
  return k;
}

// Writes Rice codes into a byte buffer. Branch-free on the common path: each code is put with
// one 8-byte store, advancing by the whole bytes filled. Kept as a plain value type (no
// pointers to it escape) so that the compiler holds its state in registers.
class RiceSink {
 public:
  static constexpr uint64_t kBatch = 4096;  // codes between capacity checks
  static constexpr uint64_t kBatchBytes = kBatch * ((kRiceMaxBits + 7) / 8) + 16;

  explicit RiceSink(std::vector<uint8_t>& buffer) : buffer_(&buffer) {
    if (buffer.size() < kBatchBytes) buffer.resize(kBatchBytes);
    out_ = buffer.data();
  }

  // Makes room for kBatch more codes.
  void Reserve() {
    const uint64_t used = static_cast<uint64_t>(out_ - buffer_->data());
    if (buffer_->size() - used < kBatchBytes) {
      buffer_->resize(std::max<uint64_t>(2 * buffer_->size(), used + kBatchBytes));
      out_ = buffer_->data() + used;
    }
  }

  ABSL_ATTRIBUTE_ALWAYS_INLINE void PutRice(uint64_t v, unsigned k) {
    const uint64_t q = v >> k;
    const uint64_t low = v & ((uint64_t{1} << k) - 1);  // k <= kRiceMaxK < 64
    if (q < kRiceMaxUnary && q + 1 + k <= 56) {         // q ones, a zero, the k low bits, at once
      Put(((uint64_t{1} << q) - 1) | (low << (q + 1)), static_cast<unsigned>(q + 1 + k));
    } else if (q < kRiceMaxUnary) {
      Put((uint64_t{1} << q) - 1, static_cast<unsigned>(q) + 1);
      PutLong(low, k);
    } else {
      const unsigned length = BitLength(v);
      Put((uint64_t{1} << kRiceMaxUnary) - 1, kRiceMaxUnary);
      Put(length, 7);
      PutLong(v, length);
    }
  }

  // Flushes the last partial byte (zero-padded); returns the stream's length in bytes.
  uint64_t Finish() {
    if (filled_ > 0) *out_++ = static_cast<uint8_t>(acc_);
    acc_ = 0;
    filled_ = 0;
    return static_cast<uint64_t>(out_ - buffer_->data());
  }

 private:
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Put(uint64_t bits, unsigned count) {  // count <= 56
    acc_ |= bits << filled_;
    filled_ += count;
    StoreFixed<uint64_t>(out_, acc_);
    const unsigned whole = filled_ >> 3;  // filled_ <= 63, so whole <= 7
    out_ += whole;
    acc_ >>= 8 * whole;
    filled_ &= 7;
  }
  void PutLong(uint64_t bits, unsigned count) {  // count <= 64
    if (count > 32) {
      Put(bits & 0xffffffffu, 32);
      bits >>= 32;
      count -= 32;
    }
    Put(bits & ((uint64_t{1} << count) - 1), count);
  }

  std::vector<uint8_t>* buffer_;
  uint8_t* out_;
  uint64_t acc_ = 0;
  unsigned filled_ = 0;  // bits in acc_, below 8 between puts
};

// Writes the Rice streams of two value arrays of the same length in one loop: the two code
// chains are independent, so they run in parallel. Returns the streams' lengths in bytes.
// Always inlined, so that a caller compiled for BMI2 gets single-instruction shifts.
ABSL_ATTRIBUTE_ALWAYS_INLINE inline void WriteRiceStreams(const uint64_t* a, unsigned a_k,
                                                          std::vector<uint8_t>& a_out,
                                                          const uint64_t* b, unsigned b_k,
                                                          std::vector<uint8_t>& b_out, uint64_t n,
                                                          uint64_t& a_bytes, uint64_t& b_bytes) {
  RiceSink a_sink(a_out), b_sink(b_out);
  for (uint64_t i = 0; i < n; ++i) {
    if (i % RiceSink::kBatch == 0) {
      a_sink.Reserve();
      b_sink.Reserve();
    }
    a_sink.PutRice(a[i], a_k);
    b_sink.PutRice(b[i], b_k);
  }
  a_bytes = a_sink.Finish();
  b_bytes = b_sink.Finish();
}

// Reads a Rice stream of `bytes` bytes followed by at least kRicePadding readable bytes. It never
// reads past the padding as long as the caller checks Overrun() after every value (a value moves
// the position by at most kRiceMaxBits bits).
class RiceReader {
 public:
  RiceReader(const uint8_t* data, uint64_t bytes) : data_(data), end_bit_(bytes * 8) {}

  // False when the code is malformed (an escape with a bad length).
  ABSL_ATTRIBUTE_ALWAYS_INLINE bool GetRice(unsigned k, uint64_t& v) {
    const uint64_t window = Peek();
    // The top bit caps the count at 63 (an escape) when the window is all ones.
    const unsigned ones = static_cast<unsigned>(__builtin_ctzll(~window | (uint64_t{1} << 63)));
    if (ones < kRiceMaxUnary) {
      position_ += ones + 1;
      v = (uint64_t{ones} << k) | GetLong(k);
      return true;
    }
    position_ += kRiceMaxUnary;
    const unsigned length = static_cast<unsigned>(Get(7));
    if (length == 0 || length > 64) return false;
    v = GetLong(length);
    // Canonical only: the encoder escapes exactly these values, with their exact length.
    return BitLength(v) == length && (v >> k) >= kRiceMaxUnary;
  }

  // True once reading went past the end of the stream.
  bool Overrun() const { return position_ > end_bit_; }
  // True when every byte was read and the unread bits of the last one are zero, as the writer
  // leaves them.
  bool AtCleanEnd() const {
    if (position_ > end_bit_ || end_bit_ - position_ >= 8) return false;
    const uint64_t rest = end_bit_ - position_;
    return rest == 0 || (Peek() & ((uint64_t{1} << rest) - 1)) == 0;
  }

 private:
  // At least 57 bits from the position on.
  uint64_t Peek() const { return LoadFixed<uint64_t>(data_ + (position_ >> 3)) >> (position_ & 7); }
  uint64_t Get(unsigned count) {  // count <= 32
    const uint64_t bits = Peek() & ((uint64_t{1} << count) - 1);
    position_ += count;
    return bits;
  }
  uint64_t GetLong(unsigned count) {  // count <= 64
    if (count <= 32) return Get(count);
    const uint64_t low = Get(32);
    return low | (Get(count - 32) << 32);
  }

  const uint8_t* data_;
  uint64_t end_bit_;
  uint64_t position_ = 0;
};

}  // namespace refit::delta::internal
