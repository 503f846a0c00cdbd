#pragma once

// Internal to daemon/bucket: XXH3-64 from libxxhash, through the library's runtime CPU dispatch
// on x86-64 (AVX2 / AVX-512 where present); the values are the same either way. Thread-safe.

#include <xxhash.h>

#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // redefines XXH3_64bits and XXH3_64bits_update
#endif
