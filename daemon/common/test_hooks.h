#pragma once

// Test hooks. In refitd they are no-ops (weak definitions in test_hooks_off.cc); the test build
// //daemon:refitd_testing links //daemon/common:test_hooks, whose definitions act. Fault
// switches and test knobs therefore never ship in the production binary: setting
// REFIT_FAULT_... in refitd's environment does nothing.
//
// Thread-safety: any thread.

namespace refit {

// On a worker's path (e.g. "dataplane", once per turn of its loop): in the test build, wedges
// the worker named by $REFIT_TEST_WEDGE while the file $REFIT_TEST_WEDGE_FILE exists.
void TestHookWedge(const char* worker);

// In the test build, the value of the environment variable `name` (a fault switch such as
// REFIT_FAULT_RELAY_FLIP, or a test knob such as REFIT_TEST_PIN_LEASE_MS); in refitd, null.
const char* TestSwitch(const char* name);

}  // namespace refit
