// The production binary's test hooks: none (test_hooks.h). Weak, so that the test build's
// //daemon/common:test_hooks replaces them.

#include "daemon/common/test_hooks.h"

namespace refit {

__attribute__((weak)) void TestHookWedge(const char*) {}

__attribute__((weak)) void TestHookKillAt(const char*) {}

__attribute__((weak)) const char* TestSwitch(const char*) { return nullptr; }

}  // namespace refit
