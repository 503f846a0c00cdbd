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

// At a commit point (`point`: "publish" inside Publish after the snapshot, "pull_complete" when a
// pull has landed and verified, "apply" half-way through an Apply's copy): in the test build,
// SIGKILLs refitd when $REFIT_TEST_KILL_AT names the point ("publish", or "publish:N" for the
// Nth time it is reached) and, when $REFIT_TEST_KILL_FILE is set, only while that file exists
// (hits count only then). The fault suite (tests/faults_kill_test.cc) kills refitd this way.
void TestHookKillAt(const char* point);

// In the test build, the value of the environment variable `name` (a fault switch such as
// REFIT_FAULT_RELAY_FLIP, or a test knob such as REFIT_TEST_PIN_LEASE_MS); in refitd, null.
const char* TestSwitch(const char* name);

}  // namespace refit
