#pragma once

// Copies with non-temporal (streaming) stores: the destination lines are written without being
// read into cache first, which nearly doubles the rate of a copy into memory that isn't read
// again soon (a version slot, an engine's weights) for pieces under glibc's own streaming
// threshold. x86-64 (SSE2); a plain memcpy elsewhere.

#include <cstdint>

namespace refit {

void StreamCopy(uint8_t* to, const uint8_t* from, uint64_t n);

// Orders the calling thread's streaming stores before whatever later reports the copy done
// (another thread must not see "done" before the bytes). Call once per thread after its copies.
void StoreFence();

}  // namespace refit
