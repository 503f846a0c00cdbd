// TCP ports for tests whose daemons must know each other's ports before they start.

#ifndef REFIT_TESTS_TESTING_PORTS_H_
#define REFIT_TESTS_TESTING_PORTS_H_

namespace refit::testing {

// A port on 127.0.0.1 that nothing listened on a moment ago and that this process has not been
// handed before. The kernel may give a port-0 bind a port it gave the previous (closed) one,
// so two calls in a row could return the same port, and two daemons started on it fail (or,
// with SO_REUSEPORT, silently share it); the ports handed out are remembered to rule that out.
// Aborts the test process if no fresh port turns up.
int FreePort();

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_PORTS_H_
