"""Errors raised by the refit client.

Every failed call to the daemon raises a `RefitError` subclass chosen by its gRPC status code
(see the status-code table in docs/api.md), so callers can catch exactly the case they handle:

    try:
        client.apply("llama", buffers, version=7)
    except refit.NotFoundError:        # version 7 already dropped by --retain
        client.apply("llama", buffers)  # take the newest instead
"""

from typing import Dict, Optional, Type

import grpc


class RefitError(Exception):
    """A refit call failed. `code` is the grpc.StatusCode, `details` the daemon's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: Optional[grpc.StatusCode] = None, what: str = ""):
        if code is not None:
            self.code = code
        self.details = details
        self.what = what
        prefix = f"{what}: " if what else ""
        super().__init__(f"{prefix}{self.code.name}: {details}")


class InvalidArgumentError(RefitError):
    """Malformed slices: out of bounds, overlapping, shape/dtype disagreement, region too small."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(RefitError):
    """A shm object, buffer id or version (dropped by --retain) that does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(RefitError):
    """A version not newer than the last published one, or not complete on this node."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceededError(RefitError, TimeoutError):
    """A wait ran past its timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(RefitError, ConnectionError):
    """No daemon answers on the socket, or a peer holding needed bytes is gone."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhaustedError(RefitError):
    """The daemon's version slots would pass --max-slot-memory (a Publish changed nothing)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDeniedError(RefitError, PermissionError):
    """This caller's uid may not do that: not allowed on the socket, someone else's buffer or
    memfd token, or memory its uid could not open itself."""

    code = grpc.StatusCode.PERMISSION_DENIED


class CancelledError(RefitError):
    """The call was cancelled (e.g. a Watch ended by `cancel()`)."""

    code = grpc.StatusCode.CANCELLED


_BY_CODE: Dict[grpc.StatusCode, Type[RefitError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, FailedPreconditionError,
                DeadlineExceededError, UnavailableError, ResourceExhaustedError, CancelledError,
                PermissionDeniedError)
}


def from_rpc_error(error: grpc.RpcError, what: str) -> RefitError:
    """The RefitError for a failed gRPC call (`what` names the RPC, for the message)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, RefitError)
    return cls(details or "", code=code, what=what)


def from_code(code_name: str, details: str, what: str) -> RefitError:
    """The RefitError for a status code given by name ("PERMISSION_DENIED"), as refitd's
    fd-passing answer gives it."""
    code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, RefitError)
    return cls(details, code=code, what=what)
