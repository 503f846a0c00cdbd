"""Memory regions a client lends the daemon: host memory (a sealed memfd, the default, or a
named POSIX shm object) or a CUDA allocation.

A region owns its memory: MemfdRegion creates an anonymous memfd sealed against shrinking (its
fd is passed to refitd over the socket, SCM_RIGHTS); HostRegion creates (and unlinks on close) a
shm object; CudaRegion allocates with torch's caching allocator and exports it as a
cudaIpcMemHandle_t. Each exposes `bytes`, a 1-D uint8 torch tensor over the whole region, from
which Buffer cuts typed views. Not thread-safe; one owner (a Buffer) closes it.
"""

import fcntl
import itertools
import mmap
import os
import re
import secrets
import weakref
from typing import Optional

import torch

from refit.v1 import refit_pb2

SHM_DIR = "/dev/shm"  # glibc's shm_open("/name") is the file /dev/shm/name
CUDA_IPC_HANDLE_BYTES = 64

_counter = itertools.count()


def unique_shm_name(*tags: str) -> str:
    """A fresh shm_open-style name: "/refit-<pid>-<tags>-<n>-<random>", safe characters only.

    The random part matters: processes in different PID namespaces (containers, sandboxed
    tests) can share a pid and one /dev/shm.
    """
    parts = ["refit", str(os.getpid())]
    parts += [re.sub(r"[^A-Za-z0-9_.-]", "_", t)[:64] for t in tags if t]
    parts += [str(next(_counter)), secrets.token_hex(4)]
    return "/" + "-".join(parts)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _drop_mapping(region) -> None:
    """Lets go of a region's mapping without unmapping it: torch.frombuffer tensors keep a
    reference to the mmap object but no buffer export, so mmap.close() would unmap the pages
    under tensors still alive (a bound model's parameters, a kept view) and reading them would
    crash. Dropping the references unmaps it when the last tensor viewing it goes (at once when
    none is left)."""
    region.bytes = None
    region._mmap = None


class HostRegion:
    """A new POSIX shm object of `size` bytes, mapped read-write; unlinked by close()."""

    memory = "host"
    kind = "shm"

    def __init__(self, name: str, size: int, replace: bool = False):
        if not name.startswith("/") or "/" in name[1:] or len(name) < 2 or len(name) > 255:
            raise ValueError(f"shm name {name!r} must look like '/name' (one leading slash)")
        if size <= 0:
            raise ValueError("a shared-memory region needs at least one byte")
        self.name = name
        self.size = size
        self._path = SHM_DIR + name
        if replace:
            _unlink_quietly(self._path)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o660)
        try:
            # Reserve the pages now: a full /dev/shm is an OSError here, not a SIGBUS later.
            os.posix_fallocate(fd, 0, size)
            self._mmap: Optional[mmap.mmap] = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink_quietly(self._path)
            raise
        finally:
            os.close(fd)
        # Unlink even if the owner forgets: at garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, _unlink_quietly, self._path)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def memory_handle(self) -> refit_pb2.MemoryHandle:
        return refit_pb2.MemoryHandle(host_shm=refit_pb2.HostShm(name=self.name), offset=0,
                                      size=self.size)

    def close(self) -> None:
        """Unlinks the name. The mapping goes once no tensor view of it is left alive."""
        self._finalizer()
        _drop_mapping(self)

    def describe(self) -> str:
        return f"host shm {self.name} ({self.size} bytes)"


# What MemfdRegion seals: its size is final. refitd refuses memfds without F_SEAL_SHRINK.
MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MemfdRegion:
    """A new anonymous memfd of `size` bytes, sealed against shrinking and growing, mapped
    read-write. Nobody can truncate it under refitd; the memory goes with the last fd and
    mapping (nothing to unlink). `fd` is what Client passes to refitd."""

    memory = "host"
    kind = "memfd"
    name = None  # no shm_open name

    def __init__(self, size: int, label: str = "refit"):
        if size <= 0:
            raise ValueError("a shared-memory region needs at least one byte")
        self.size = size
        self.label = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:200] or "refit"
        self.fd = os.memfd_create(self.label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Reserve the pages now: running out of memory is an OSError here, not later.
            os.posix_fallocate(self.fd, 0, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
            self._mmap: Optional[mmap.mmap] = mmap.mmap(
                self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def memory_handle(self, token: str) -> refit_pb2.MemoryHandle:
        """The handle naming this memfd by the token refitd gave for its fd."""
        return refit_pb2.MemoryHandle(memfd=refit_pb2.Memfd(token=token), offset=0,
                                      size=self.size)

    def close(self) -> None:
        """Closes the fd. The mapping goes once no tensor view of it is left alive."""
        self._finalizer()
        _drop_mapping(self)

    def describe(self) -> str:
        return f"host memfd {self.label} ({self.size} bytes)"


def require_cuda(device: torch.device) -> None:
    """Raises RuntimeError with a clear message where `device` is not a usable CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"refit: a CUDA buffer on {device} needs a CUDA build of torch and a visible GPU, "
            f"but torch.cuda.is_available() is False (torch {torch.__version__}); "
            "register CPU tensors instead (they go through POSIX shared memory)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"refit: no CUDA device {index} "
                           f"({torch.cuda.device_count()} visible)")


def gpu_uuid(properties) -> str:
    """nvidia-smi's form of a device's UUID ("GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a") from
    torch.cuda.get_device_properties(i), or "" where this torch does not expose it (torch < 2.0):
    refitd then falls back to the ordinal, which is only right without CUDA_VISIBLE_DEVICES
    remapping."""
    uuid = getattr(properties, "uuid", None)
    if uuid is None:
        return ""
    raw = getattr(uuid, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        text = bytes(raw).hex()
    else:  # str(uuid) is the UUID's text, with or without the "GPU-" prefix and dashes
        text = str(uuid).lower()
        if text.startswith("gpu-"):
            text = text[4:]
        text = text.replace("-", "")
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        return ""
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _untyped_storage(tensor: torch.Tensor):
    if hasattr(tensor, "untyped_storage"):  # torch >= 2.0
        return tensor.untyped_storage()
    return tensor.storage().untyped()  # torch 1.13


def cuda_ipc_handle(shared: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside the handle torch's `_share_cuda_()` gives. Older
    torch gives the handle itself; newer torch (its caching allocator's shareable handle)
    prefixes a version byte and a type byte: 'c' (a cudaMalloc block, the handle follows) or
    'e' (an expandable segment, which has no cudaIpcMemHandle_t: RuntimeError naming the fix).
    Anything else: RuntimeError."""
    shared = bytes(shared)
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise RuntimeError(
            "refit: torch gave an expandable-segment handle (no cudaIpcMemHandle_t): set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before torch allocates")
    if len(shared) == CUDA_IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    raise RuntimeError(
        f"refit: a {len(shared)}-byte CUDA IPC handle from torch, neither a "
        f"{CUDA_IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t nor one behind torch's version and "
        "type bytes (expandable segments? set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")


def torch_cuda_block(tensor: torch.Tensor):
    """(device, cudaIpcMemHandle_t, address of the cudaMalloc block) of a CUDA tensor."""
    storage = _untyped_storage(tensor)
    shared = storage._share_cuda_()
    # (device, handle, storage_size_bytes, storage_offset_bytes, ...): the storage starts
    # storage_offset_bytes into the block the handle names.
    return int(shared[0]), cuda_ipc_handle(shared[1]), storage.data_ptr() - int(shared[3])


class CudaIpcBlock:
    """[offset, offset + size) of a cudaMalloc block named by its CUDA IPC handle: what refitd
    is given for CUDA memory (CudaRegion, and the engine parameters of engine_storage)."""

    memory = "cuda"
    kind = "cuda_ipc"
    name = None

    def _set_block(self, device: int, handle: bytes, offset: int, size: int,
                   device_uuid: str) -> None:
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise RuntimeError(
                f"refit: a {len(handle)}-byte CUDA IPC handle, not a "
                f"{CUDA_IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t (expandable segments? set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
        self.device, self.handle, self.offset, self.size = device, handle, offset, size
        self.device_uuid = device_uuid

    def memory_handle(self) -> refit_pb2.MemoryHandle:
        return refit_pb2.MemoryHandle(
            cuda_ipc=refit_pb2.CudaIpc(handle=self.handle, device=self.device,
                                       device_uuid=self.device_uuid),
            offset=self.offset, size=self.size)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class CudaRegion(CudaIpcBlock):
    """`size` bytes of CUDA memory on `device`, exported with cudaIpcGetMemHandle.

    The handle names the whole cudaMalloc block that torch's caching allocator carved this
    region from, so the region is [offset, offset + size) of that block.
    """

    def __init__(self, size: int, device: torch.device):
        require_cuda(device)
        if size <= 0:
            raise ValueError("a CUDA region needs at least one byte")
        self.size = size
        self.bytes = torch.empty(size, dtype=torch.uint8, device=device)
        shared = _untyped_storage(self.bytes)._share_cuda_()
        # (device, handle, storage_size_bytes, storage_offset_bytes, ref counter..., event...)
        device = int(shared[0])
        self._set_block(device, bytes(shared[1]), int(shared[3]), size,
                        gpu_uuid(torch.cuda.get_device_properties(device)))

    def close(self) -> None:
        self.bytes = None  # back to the caching allocator once no view is left

    def describe(self) -> str:
        return f"cuda:{self.device} ipc region ({self.size} bytes at offset {self.offset})"
