"""LeaseKeeper: renews leased buffers every third of the lease, drops the ones refitd no longer
knows, stops with the client (argv[1], refitd's path, is not needed here)."""

import sys
import threading
import time
import unittest

from refit import leases
from refit.v1 import refit_pb2


class LeaseKeeperTest(unittest.TestCase):
    def test_renews_drops_unknown_and_stops(self):
        calls = []
        done = threading.Event()

        def renew(request, timeout):
            calls.append((sorted(request.buffer_ids), timeout))
            if len(calls) >= 3:
                done.set()
            return refit_pb2.RenewLeasesResponse(unknown_ids=["gone"])

        keeper = leases.LeaseKeeper(renew)
        keeper.add("a", 300)      # renewed every 0.1 s
        keeper.add("gone", 300)
        keeper.add("never", 0)    # not leased: never renewed
        self.assertTrue(done.wait(5))
        keeper.stop()
        self.assertEqual(calls[0][0], ["a", "gone"])
        self.assertAlmostEqual(calls[0][1], 0.1, places=3)
        self.assertEqual(calls[-1][0], ["a"])  # "gone" was dropped after the first answer
        n = len(calls)
        time.sleep(0.3)
        self.assertEqual(len(calls), n)  # stopped

    def test_failures_are_retried_and_remove_stops_renewing(self):
        calls = []

        def renew(request, timeout):
            calls.append(sorted(request.buffer_ids))
            raise RuntimeError("refitd is restarting")

        keeper = leases.LeaseKeeper(renew)
        keeper.add("a", 150)
        time.sleep(0.3)
        self.assertGreaterEqual(len(calls), 2)
        keeper.remove("a")
        time.sleep(0.1)
        n = len(calls)
        time.sleep(0.3)
        self.assertEqual(len(calls), n)
        keeper.stop()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
