#include "daemon/memory/stream_copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace refit {

void StreamCopy(uint8_t* to, const uint8_t* from, uint64_t n) {
#if defined(__SSE2__)
  const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(to) & 15)) & 15;
  if (n < head + 64) {
    std::memcpy(to, from, n);
    return;
  }
  std::memcpy(to, from, head);
  to += head;
  from += head;
  n -= head;
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
  }
  std::memcpy(to + i, from + i, n - i);
#else
  std::memcpy(to, from, n);
#endif
}

void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace refit
