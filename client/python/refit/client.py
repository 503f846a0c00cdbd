"""refit.Client: talks to the node's refitd over its Unix socket.

    client = refit.Client()                                   # $REFIT_SOCKET or the default
    buf = client.register("llama", refit.SOURCE, model.state_dict())
    client.publish("llama", 1, [buf])

A Client is thread-safe (gRPC channels are); Buffers and Watches belong to one thread each.
"""

import errno
import os
import socket as socket_lib
import stat
import sys
import threading
import time
from typing import Dict, Iterable, Iterator, List, Optional, Union

import grpc
import torch

from refit import buffer as buffer_lib
from refit import errors
from refit import leases
from refit import memory
from refit.v1 import refit_pb2, refit_pb2_grpc

DEFAULT_SOCKET = "/run/refit/refitd.sock"
_MAX_MESSAGE_BYTES = 64 << 20
# refitd's fd-passing preface (docs/api.md "Sealed memfds"), sent with the fd attached.
_FD_PREFACE = b"REFITFD1"

BufferArg = Union[buffer_lib.Buffer, str]


def default_socket_path() -> str:
    """`$REFIT_SOCKET`, else /run/refit/refitd.sock (the daemon's own default)."""
    return os.environ.get("REFIT_SOCKET") or DEFAULT_SOCKET


def _probe_socket(path: str) -> None:
    """Raises at once when no refitd can be behind `path`: the socket file is missing, is not
    a socket, or nothing listens on it. A socket that accepts (or is slow to) is left to gRPC
    and the connect timeout."""
    hint = " (is refitd running? pass socket= or set $REFIT_SOCKET for another socket)"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise errors.UnavailableError(
            f"no refitd at {path}: the socket does not exist{hint}", what="connect") from None
    except NotADirectoryError:
        raise errors.UnavailableError(
            f"no refitd at {path}: the socket does not exist{hint}", what="connect") from None
    if not stat.S_ISSOCK(mode):
        raise errors.UnavailableError(
            f"no refitd at {path}: it exists but is not a socket{hint}", what="connect")
    probe = socket_lib.socket(socket_lib.AF_UNIX, socket_lib.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        raise errors.UnavailableError(
            f"no refitd at {path}: nothing listens on the socket (a refitd that exited left "
            f"it){hint}", what="connect") from None
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EINPROGRESS):
            raise errors.UnavailableError(f"cannot connect to {path}: {e.strerror}{hint}",
                                          what="connect") from None
    finally:
        probe.close()


def parse_role(role: Union[int, str]) -> int:
    """refit.SOURCE / refit.DESTINATION, or "source" / "destination"."""
    if isinstance(role, str):
        try:
            return refit_pb2.Role.Value(role.upper())
        except ValueError:
            raise ValueError(f"role {role!r} is neither 'source' nor 'destination'") from None
    if role not in (refit_pb2.SOURCE, refit_pb2.DESTINATION):
        raise ValueError(f"role {role!r} is neither refit.SOURCE nor refit.DESTINATION")
    return role


def _buffer_ids(buffers: Union[BufferArg, Iterable[BufferArg]]) -> List[str]:
    if isinstance(buffers, (str, buffer_lib.Buffer)):
        buffers = [buffers]
    return [b.buffer_id if isinstance(b, buffer_lib.Buffer) else b for b in buffers]


def _sync_cuda(buffers) -> None:
    """Publish reads the buffers at once: finish the writes queued on CUDA streams first."""
    if isinstance(buffers, (str, buffer_lib.Buffer)):
        buffers = [buffers]
    for b in buffers:
        if isinstance(b, buffer_lib.Buffer) and b.memory == "cuda":
            b.region.synchronize()


class Watch:
    """A live Watch stream: iterate for VersionEvents (`event.version`), in order.

    In place once constructed: every version completing afterwards is yielded. `cancel()` (from
    any thread) or leaving the `with` block ends the iteration without an error.
    """

    def __init__(self, stub: refit_pb2_grpc.RefitStub, model: str, after_version: int,
                 timeout: Optional[float], client: Optional["Client"] = None):
        self._cancelled = False
        self._stub, self._model, self._timeout, self._client = stub, model, timeout, client
        self._last = after_version
        self._open()
        if self._last == 0 and client is not None:
            # "From now": remember where now was, to resume from it on another refitd.
            try:
                self._last = next((m.latest_version for m in client.status().models
                                   if m.model == model), 0)
            except errors.RefitError:
                pass

    def _open(self) -> None:
        self._call = self._stub.Watch(
            refit_pb2.WatchRequest(model=self._model, after_version=self._last),
            timeout=self._timeout)
        # The daemon sends initial metadata once its watch is registered; a call that failed
        # (bad model name, no daemon) ends here too, and is raised now.
        self._call.initial_metadata()
        if self._call.done() and self._call.code() != grpc.StatusCode.OK:
            raise errors.from_rpc_error(self._call, "Watch")

    def __iter__(self) -> Iterator[refit_pb2.VersionEvent]:
        return self

    def __next__(self) -> refit_pb2.VersionEvent:
        while True:
            try:
                event = next(self._call)
                self._last = event.version
                return event
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    raise StopIteration from None
                # refitd went away: once it (or its successor) answers, the watch resumes
                # after the last version seen (a restarted refitd replays what it completed).
                if (e.code() == grpc.StatusCode.UNAVAILABLE and not self._cancelled
                        and self._client is not None and self._client._await_refitd(e)):
                    self._open()
                    continue
                raise errors.from_rpc_error(e, "Watch") from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """A connection to one refitd. Raises refit.UnavailableError at once when the socket does
    not exist or nothing listens on it, and after `connect_timeout` when it exists but no
    refitd answers.

    `call_timeout` bounds every call that does not wait for versions (seconds).
    """

    def __init__(self, socket: Optional[str] = None, connect_timeout: float = 5.0,
                 call_timeout: float = 60.0):
        self.socket = socket or default_socket_path()
        self.call_timeout = call_timeout
        _probe_socket(self.socket)
        self._channel = grpc.insecure_channel(
            "unix:" + self.socket,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                     # A restarted refitd is found again within a second.
                     ("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise errors.UnavailableError(
                f"no refitd answers at {self.socket} within {connect_timeout:g} s (the socket "
                "exists; is refitd stuck? pass socket= or set $REFIT_SOCKET for another "
                "socket)",
                what="connect") from None
        self._stub = refit_pb2_grpc.RefitStub(self._channel)
        # Renews leases when refitd can't watch this process (RegisterBufferResponse.lease_ms).
        self._leases = leases.LeaseKeeper(
            lambda request, timeout: self._stub.RenewLeases(request, timeout=timeout))
        # Riding out a restarted refitd: how to register each buffer again (by the id it was
        # first given, which callers keep using), and the id refitd knows it by now.
        self.restart_timeout = 60.0
        self._remake = {}   # first id -> () -> RegisterBufferRequest
        self._current = {}  # first id -> current id
        self._restart_lock = threading.Lock()

    def close(self) -> None:
        self._leases.stop()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, request, timeout: Optional[float] = None):
        """Calls `name` with `request` (or what the callable `request` makes, again after a
        restart of refitd, so that it names the buffers' new ids)."""
        method = getattr(self._stub, name)
        for attempt in (0, 1):
            try:
                return method(request() if callable(request) else request,
                              timeout=self.call_timeout if timeout is None else timeout)
            except grpc.RpcError as e:
                if attempt == 0 and self._recover(e):
                    continue
                raise errors.from_rpc_error(e, name) from None

    def _ids(self, ids: List[str]) -> List[str]:
        return [self._current.get(i, i) for i in ids]

    def _status_when_back(self):
        """refitd's Status once it answers, within `restart_timeout`; None if it doesn't."""
        deadline = time.monotonic() + self.restart_timeout
        delay = 0.05
        while True:
            try:
                return self._stub.Status(refit_pb2.StatusRequest(), timeout=2.0)
            except grpc.RpcError:
                if time.monotonic() + delay > deadline:
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _await_refitd(self, error: grpc.RpcError) -> bool:
        """For a stream that ended UNAVAILABLE: True once refitd answers again (this client's
        buffers registered again if it restarted)."""
        if self._remake:
            self._recover(error)
        return self._status_when_back() is not None

    def _recover(self, error: grpc.RpcError) -> bool:
        """After UNAVAILABLE (refitd down) or NOT_FOUND (a model or buffer it doesn't know):
        waits up to `restart_timeout` for refitd to answer, registers every buffer of this
        client again if refitd no longer knows them (it restarted), and says whether to retry."""
        code = error.code()
        if not self._remake or code not in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.NOT_FOUND):
            return False
        with self._restart_lock:
            status = self._status_when_back()
            if status is None:
                return False
            known = {b.buffer_id for m in status.models for b in m.buffers}
            if any(i in known for i in self._current.values()):
                return code == grpc.StatusCode.UNAVAILABLE  # same refitd: a transient error
            for first, remake in list(self._remake.items()):
                response = self._stub.RegisterBuffer(remake(), timeout=self.call_timeout)
                self._leases.remove(self._current.get(first, first))
                self._current[first] = response.buffer_id
                self._leases.add(response.buffer_id, response.lease_ms)
            return True

    # ---- buffers ----

    def register(self, model: str, role: Union[int, str], tensors: buffer_lib.TensorsArg, *,
                 shm_name: Optional[str] = None, client_name: Optional[str] = None,
                 alignment: int = 64, host_memory: Optional[str] = None) -> buffer_lib.Buffer:
        """Lends the daemon a new region holding `tensors`, as SOURCE or DESTINATION.

        `tensors` is a dict name -> torch.Tensor (a whole tensor) or refit.Slice, e.g. a
        model's state_dict(), or a list of named Slices. The region is one CUDA allocation for
        CUDA tensors; for CPU tensors it is, by default (`host_memory="memfd"`), an anonymous
        memfd sealed against shrinking whose fd is passed to refitd over the socket, or with
        `host_memory="shm"` (implied by `shm_name`) a named POSIX shm object. The tensors'
        current values are copied in, back to back at multiples of `alignment` bytes. Returns
        the Buffer, whose `tensors` view the region.
        """
        if host_memory is None:
            host_memory = "shm" if shm_name else "memfd"
        if host_memory not in ("memfd", "shm"):
            raise ValueError(f"host_memory must be 'memfd' or 'shm', not {host_memory!r}")
        if shm_name and host_memory != "shm":
            raise ValueError("shm_name names a POSIX shm object: use host_memory='shm'")
        role = parse_role(role)
        slices = buffer_lib.normalize(tensors)
        devices = {s.device for s in slices}
        if len(devices) != 1:
            raise ValueError("one buffer's tensors must share a device, not "
                             f"{sorted(map(str, devices))}")
        device = devices.pop()
        if device.type == "cuda":
            alignment = max(alignment, 256)
        elif device.type != "cpu":
            raise ValueError(f"refit buffers live in host or CUDA memory, not on {device}")
        layouts, size = buffer_lib.layout(slices, alignment)
        if device.type == "cuda":
            region = memory.CudaRegion(size, device)
        elif host_memory == "memfd":
            region = memory.MemfdRegion(
                size, label=f"refit-{model}-{refit_pb2.Role.Name(role).lower()}")
        else:
            region = memory.HostRegion(
                shm_name or memory.unique_shm_name(model, refit_pb2.Role.Name(role).lower()),
                size)  # FileExistsError when a given shm_name exists
        try:
            with torch.no_grad():
                for s, lay in zip(slices, layouts):
                    if s.tensor is not None:
                        buffer_lib.typed_view(region.bytes, lay).copy_(s.tensor)
        except BaseException:
            region.close()
            raise
        return self.register_region(model, role, region, layouts, client_name=client_name)

    def register_region(self, model: str, role: Union[int, str], region,
                        layouts: List[buffer_lib.SliceLayout], *,
                        client_name: Optional[str] = None) -> buffer_lib.Buffer:
        """Registers a region this process already holds (a MemfdRegion, HostRegion or CUDA
        region) with tensors already placed in it (`layouts`); its values are left as they
        are. The Buffer owns the region from here on (closed on failure or release)."""
        role = parse_role(role)
        try:
            if region.memory == "cuda":
                region.synchronize()
            name = client_name if client_name is not None else _default_client_name()

            def remake(region=region):
                # A memfd is passed again (a token serves one registration).
                if region.kind == "memfd":
                    handle = region.memory_handle(self.pass_memfd(region.fd))
                else:
                    handle = region.memory_handle()
                return refit_pb2.RegisterBufferRequest(
                    model=model, role=role, memory=handle,
                    tensors=[lay.to_proto() for lay in layouts], client=name)

            response = self._call("RegisterBuffer", remake())
            self._leases.add(response.buffer_id, response.lease_ms)
            self._remake[response.buffer_id] = remake
            self._current[response.buffer_id] = response.buffer_id
        except BaseException:
            region.close()
            raise
        return buffer_lib.Buffer(self, model, role, response.buffer_id, region, layouts)

    def register_request(self, request: refit_pb2.RegisterBufferRequest) -> str:
        """Registers memory the caller manages itself; returns the buffer id."""
        response = self._call("RegisterBuffer", request)
        self._leases.add(response.buffer_id, response.lease_ms)
        self._remake[response.buffer_id] = lambda: request
        self._current[response.buffer_id] = response.buffer_id
        return response.buffer_id

    def pass_memfd(self, fd: int) -> str:
        """Passes the memfd `fd` (this process keeps it) to refitd over the socket with
        SCM_RIGHTS; returns the token that names it in one RegisterBuffer
        (`MemoryHandle(memfd=Memfd(token=...))`) by this uid within 60 s. refitd refuses, at
        RegisterBuffer, a memfd not sealed with F_SEAL_SHRINK (FailedPreconditionError)."""
        with socket_lib.socket(socket_lib.AF_UNIX, socket_lib.SOCK_STREAM) as side:
            side.settimeout(self.call_timeout)
            try:
                side.connect(self.socket)
                socket_lib.send_fds(side, [_FD_PREFACE], [fd])
                answer = b""
                while b"\n" not in answer and len(answer) < 4096:
                    chunk = side.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
            except OSError as e:
                raise errors.UnavailableError(
                    f"passing a memfd to refitd at {self.socket}: {e}", what="PassMemfd") from None
        line = answer.split(b"\n", 1)[0].decode("utf-8", "replace")
        if line.startswith("OK "):
            return line[3:]
        if line.startswith("ERR "):
            code_name, _, details = line[4:].partition(" ")
            raise errors.from_code(code_name, details, what="PassMemfd")
        raise errors.UnavailableError(
            f"passing a memfd to refitd at {self.socket}: no answer (a refitd older than memfd "
            f"passing?) {line[:200]!r}", what="PassMemfd")

    def release_buffer(self, buffer_id: str) -> None:
        """The daemon stops using that buffer's memory (Buffer.release() calls this)."""
        current = self._current.pop(buffer_id, buffer_id)
        self._remake.pop(buffer_id, None)
        self._leases.remove(current)
        self._call("ReleaseBuffer", refit_pb2.ReleaseBufferRequest(buffer_id=current))

    # ---- versions ----

    def publish(self, model: str, version: int,
                buffers: Union[BufferArg, Iterable[BufferArg]], *,
                labels: Optional[Dict[str, str]] = None, max_staleness: int = 0,
                timeout: Optional[float] = None, run: str = "") -> refit_pb2.PublishResponse:
        """The SOURCE `buffers` now hold `version`; returns once the daemon has snapshotted
        them (`.version`, `.bytes`), so their tensors may be overwritten at once.

        `labels`: the trainer's metadata for the version (step, run id, wall time, a label:
        at most 1 KiB of keys and values, else refit.InvalidArgumentError and nothing is
        published), delivered with it to every engine's `watch()` (`event.labels`) and shown
        in `status()` (`ModelStatus.version_labels`). Values are turned into strings.

        `max_staleness` = k > 0: a staleness budget. The call then also waits (up to
        `timeout` seconds, default the client's call timeout) until every replica of the
        model (the nodes with DESTINATION buffers for it) holds `version` - k or newer;
        refit.DeadlineExceededError naming the replicas behind otherwise (the version is
        published all the same). refit.FailedPreconditionError, nothing published, when no
        replica of the model has reported to this node.

        `run`: the trainer's run ("" : the model's current one). Naming another run starts it:
        a trainer resuming from a checkpoint (step 600 published, resumed at 500) publishes 500
        under a new run, and every engine node follows it (Watch events and status name the
        run). A run the model left before is refused (refit.FailedPreconditionError)."""
        buffers = list(buffers) if not isinstance(buffers, (str, buffer_lib.Buffer)) else buffers
        _sync_cuda(buffers)
        ids = _buffer_ids(buffers)
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        return self._call("Publish", lambda: refit_pb2.PublishRequest(
            model=model, version=version, buffer_ids=self._ids(ids), labels=labels,
            max_staleness=max_staleness, run=run), timeout=timeout)

    def wait_for_version(self, model: str, min_version: int = 1,
                         timeout: Optional[float] = None) -> int:
        """Blocks until a version >= min_version is complete on this node; returns the newest
        (during a rollback: the rollback version; newer ones are held back until resume).

        refit.DeadlineExceededError (also a TimeoutError) after `timeout` seconds
        (None: wait for ever).
        """
        return self.wait_for_target(model, min_version, timeout=timeout).version

    def wait_for_target(self, model: str, min_version: int = 1, run: str = "",
                        applied_version: int = 0,
                        timeout: Optional[float] = None) -> refit_pb2.WaitForVersionResponse:
        """wait_for_version for an engine: with the run it last saw (`run`; "" : any) it answers
        at once, even below min_version, when the model's current run is another one (a new
        run or a resume restarts its numbers); with the version its buffers hold
        (`applied_version`) it answers at once while the model is rolled back to another
        version. Returns `.version`, `.run` and `.rollback` (the version is a rollback
        target: apply it even though it is older)."""
        request = refit_pb2.WaitForVersionRequest(model=model, min_version=min_version, run=run,
                                                  applied_version=applied_version)
        try:
            response = self._stub.WaitForVersion(request, timeout=timeout)
        except grpc.RpcError as e:
            # refitd restarted under the wait: register again, then wait on the new one.
            if not self._recover(e):
                raise errors.from_rpc_error(e, "WaitForVersion") from None
            try:
                response = self._stub.WaitForVersion(request, timeout=timeout)
            except grpc.RpcError as e2:
                raise errors.from_rpc_error(e2, "WaitForVersion") from None
        return response

    def rollback(self, model: str, version: int) -> int:
        """Rolls every node with DESTINATION buffers for `model` back to `version` (still
        retained), like `refitctl rollback`: their Watch streams deliver it with `rollback`
        set, and newer versions are held back until resume(). refit.NotFoundError naming the
        oldest retained version when `version` is no longer held."""
        return self._call("Rollback", refit_pb2.RollbackRequest(model=model,
                                                                version=version)).version

    def resume(self, model: str) -> None:
        """Ends a rollback (`refitctl resume`): the newest complete version is the target
        again. refit.FailedPreconditionError when the model is not rolled back."""
        self._call("Resume", refit_pb2.ResumeRequest(model=model))

    def wait_for_replicas(self, model: str, version: int, min_nodes: int = 0,
                          timeout: Optional[float] = None) -> refit_pb2.WaitForReplicasResponse:
        """Blocks until `version` or newer is complete on at least `min_nodes` of the nodes
        holding DESTINATION buffers for `model` (0: all of them), as this node's refitd knows
        them; returns `.version` (the oldest among them) and `.nodes`.

        A trainer's staleness control: before publishing step N + 1, wait until a quorum of
        engines holds N. refit.DeadlineExceededError (also a TimeoutError) after `timeout`
        seconds, naming the replicas that are behind.
        """
        try:
            return self._stub.WaitForReplicas(
                refit_pb2.WaitForReplicasRequest(model=model, version=version,
                                                 min_nodes=min_nodes),
                timeout=timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "WaitForReplicas") from None

    def apply(self, model: str, buffers: Union[BufferArg, Iterable[BufferArg]],
              version: int = 0) -> refit_pb2.ApplyResponse:
        """Writes `version` (0: the newest complete) into the DESTINATION `buffers`,
        resharded and converted; returns `.version` and `.bytes_written`."""
        ids = _buffer_ids(buffers)
        return self._call("Apply", lambda: refit_pb2.ApplyRequest(
            model=model, version=version, buffer_ids=self._ids(ids)))

    def watch(self, model: str, after_version: int = 0,
              timeout: Optional[float] = None) -> Watch:
        """A stream of the versions of `model` completing on this node from now on; with
        `after_version` > 0, first the retained complete versions newer than it."""
        return Watch(self._stub, model, after_version, timeout, client=self)

    def timeline(self, model: str, version: int = 0,
                 local: bool = False) -> refit_pb2.TimelineResponse:
        """Each node's stages of `model`'s `version` (0: every version the nodes remember):
        `.nodes[i].node`, `.versions[j].stages[k]` (`.stage`, `.start_us`, `.end_us`,
        `.detail`), from this node and every node reachable from it (`local`: this node only),
        as `refitctl timeline` shows them."""
        return self._call("Timeline", refit_pb2.TimelineRequest(model=model, version=version,
                                                                 local=local))

    def status(self) -> refit_pb2.StatusResponse:
        """What `refitctl status` shows: node, peers, models, buffers, metrics."""
        return self._call("Status", refit_pb2.StatusRequest())

    def drop_model(self, model: str) -> refit_pb2.DropModelResponse:
        """Releases `model`'s held versions and forgets it (its remembered newest published
        version too, so a new run may start at 1), like `refitctl drop`. Raises
        refit.FailedPreconditionError while buffers of it are registered."""
        return self._call("DropModel", refit_pb2.DropModelRequest(model=model))


def _default_client_name() -> str:
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not program or program.startswith("-"):  # python3 -c / interactive
        program = "python"
    return f"{program}[{os.getpid()}]"
