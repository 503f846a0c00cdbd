"""Lease renewal for buffers refitd cannot tie to this process.

When refitd cannot see the registering process (it runs in another pid namespace, e.g. a pod
without hostPID), RegisterBufferResponse.lease_ms is non-zero and refitd releases the buffer
lease_ms after the last RenewLeases call. A daemon thread of the Client renews every third of
the lease, for as long as the buffers are registered and the Client is open.
"""

import threading
from typing import Callable, Set

from refit.v1 import refit_pb2


class LeaseKeeper:
    def __init__(self, renew: Callable[[refit_pb2.RenewLeasesRequest, float],
                                       refit_pb2.RenewLeasesResponse]):
        self._renew = renew  # (request, timeout_s) -> response; raises on failure
        self._lock = threading.Lock()
        self._ids: Set[str] = set()
        self._period = 1.0
        self._stop = threading.Event()
        self._thread = None

    def add(self, buffer_id: str, lease_ms: int) -> None:
        if lease_ms <= 0:
            return
        with self._lock:
            self._ids.add(buffer_id)
            self._period = min(self._period, max(lease_ms / 3000.0, 0.05))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="refit-leases",
                                                daemon=True)
                self._thread.start()

    def remove(self, buffer_id: str) -> None:
        with self._lock:
            self._ids.discard(buffer_id)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                ids = sorted(self._ids)
                period = self._period
            if not ids:
                continue
            try:
                response = self._renew(refit_pb2.RenewLeasesRequest(buffer_ids=ids), period)
            except Exception:  # the daemon is busy or gone: try again next period
                continue
            with self._lock:
                for buffer_id in response.unknown_ids:  # released or expired
                    self._ids.discard(buffer_id)
