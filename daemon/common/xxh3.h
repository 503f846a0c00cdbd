#pragma once

// XXH3-64 from libxxhash, the one hash refit uses for checksums (pulls, deltas, the bucket). On
// x86-64 the calls go through the library's runtime CPU dispatch (AVX2 / AVX-512 where present,
// several times the plain SSE2 entry points: docs/benchmarks.md, "Figures behind constants");
// the hash values are the same either way. Thread-safe.

#include <xxhash.h>

#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // redefines XXH3_64bits and XXH3_64bits_update
#endif
