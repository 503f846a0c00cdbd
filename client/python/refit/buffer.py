"""Slices (what a buffer holds) and Buffers (a registered region with typed tensor views).

    buf = client.register("llama", refit.SOURCE, model.state_dict())
    buf.copy_from(model.state_dict())    # after each optimizer step
    client.publish("llama", step, [buf])

A Buffer is not thread-safe: one thread writes its tensors and releases it.
"""

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from refit import dtypes
from refit.v1 import refit_pb2


class Slice:
    """One hyperrectangle of a tensor: `sizes` elements from `offsets` of `global_shape`.

    `tensor` is the local part (its shape is `sizes`); its values are copied into the buffer at
    registration. Without a tensor, give `sizes` and `dtype` (and `device` for CUDA). `dtype` is
    the dtype of the bytes in the buffer (default: the tensor's); the daemon converts between
    buffers of different float dtypes.
    """

    def __init__(self, tensor: Optional[torch.Tensor] = None, *,
                 global_shape: Optional[Sequence[int]] = None,
                 offsets: Optional[Sequence[int]] = None,
                 sizes: Optional[Sequence[int]] = None,
                 dtype: Optional[torch.dtype] = None,
                 name: Optional[str] = None,
                 device: Union[str, torch.device, None] = None,
                 refit_dtype: Optional[int] = None,
                 scale_tensor: Optional[str] = None,
                 scale_block: Optional[Sequence[int]] = None):
        if tensor is not None:
            if sizes is not None and tuple(sizes) != tuple(tensor.shape):
                raise ValueError(f"sizes {tuple(sizes)} differ from the tensor's shape "
                                 f"{tuple(tensor.shape)}")
            sizes = tuple(tensor.shape)
            dtype = dtype or tensor.dtype
            device = device or tensor.device
        if sizes is None:
            raise ValueError("a Slice needs a tensor or sizes")
        if dtype is None:
            raise ValueError("a Slice without a tensor needs a dtype")
        self.tensor = tensor
        self.sizes = tuple(int(d) for d in sizes)
        if offsets is None:
            offsets = (0,) * len(self.sizes)
        self.offsets = tuple(int(d) for d in offsets)
        if global_shape is None:
            if any(self.offsets):
                raise ValueError("a Slice with offsets needs its tensor's global_shape")
            global_shape = self.sizes
        self.global_shape = tuple(int(d) for d in global_shape)
        if not len(self.sizes) == len(self.offsets) == len(self.global_shape):
            raise ValueError(f"sizes {self.sizes}, offsets {self.offsets} and global_shape "
                             f"{self.global_shape} differ in rank")
        self.dtype = dtype
        self.name = name
        self.device = torch.device(device or "cpu")
        # The refit dtype of the bytes when torch has none for it: fp8 held as torch.uint8
        # (torch < 2.1 has no float8 dtypes), e.g. refit_dtype=refit.FP8_E4M3.
        self.refit_dtype = refit_dtype
        # fp8 destinations with block scales (docs/api.md "Engines"): the daemon quantizes per
        # block of `scale_block` global elements and writes FP32 scales into `scale_tensor`.
        self.scale_tensor = scale_tensor or ""
        self.scale_block = tuple(int(d) for d in (scale_block or ()))

    @classmethod
    def shard(cls, tensor: torch.Tensor, dim: int, index: int, count: int, **kwargs) -> "Slice":
        """Part `index` of `count` equal parts of the whole `tensor` along `dim` (TP sharding)."""
        size = tensor.shape[dim]
        if size % count:
            raise ValueError(f"dimension {dim} of size {size} does not split into {count} parts")
        part = size // count
        offsets = [0] * tensor.dim()
        offsets[dim] = index * part
        return cls(tensor.narrow(dim, index * part, part), global_shape=tuple(tensor.shape),
                   offsets=offsets, **kwargs)

    def __repr__(self) -> str:
        return (f"Slice(name={self.name!r}, dtype={self.dtype}, global_shape={self.global_shape},"
                f" offsets={self.offsets}, sizes={self.sizes}, device={self.device})")


@dataclass(frozen=True)
class SliceLayout:
    """Where a slice lies in its buffer. Shapes are the torch shapes (a 0-d tensor is ())."""

    name: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    buffer_offset: int
    nbytes: int
    refit_dtype: Optional[int] = None
    scale_tensor: str = ""
    scale_block: Tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        return self.sizes == self.global_shape

    def to_proto(self) -> refit_pb2.TensorSlice:
        # refit has no 0-d tensors: a scalar travels as shape [1].
        rank0 = len(self.global_shape) == 0
        dtype = self.refit_dtype if self.refit_dtype is not None else dtypes.to_refit(self.dtype)
        return refit_pb2.TensorSlice(
            name=self.name, dtype=dtype,
            global_shape=[1] if rank0 else list(self.global_shape),
            offsets=[0] if rank0 else list(self.offsets),
            sizes=[1] if rank0 else list(self.sizes),
            buffer_offset=self.buffer_offset,
            scale_tensor=self.scale_tensor, scale_block=list(self.scale_block))

    def region_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This slice's part of a tensor with the global shape."""
        part = whole
        for dim, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            part = part.narrow(dim, offset, size)
        return part


TensorsArg = Union[Mapping[str, Union[torch.Tensor, Slice]], Iterable[Slice]]


def normalize(tensors: TensorsArg) -> List[Slice]:
    """A dict name -> tensor/Slice, or Slices with names, as a list of named Slices."""
    out: List[Slice] = []
    if isinstance(tensors, Mapping):
        for name, value in tensors.items():
            if isinstance(value, torch.Tensor):
                value = Slice(value, name=name)
            elif isinstance(value, Slice):
                if value.name not in (None, name):
                    raise ValueError(f"Slice named {value.name!r} under key {name!r}")
                value.name = name
            else:
                raise TypeError(f"{name}: expected a torch.Tensor or refit.Slice, "
                                f"got {type(value).__name__}")
            out.append(value)
    else:
        for value in tensors:
            if not isinstance(value, Slice) or not value.name:
                raise TypeError("a list of tensors must hold refit.Slice objects with names")
            out.append(value)
    if not out:
        raise ValueError("a buffer needs at least one tensor")
    seen = set()
    for s in out:
        if s.name in seen:
            raise ValueError(f"tensor {s.name!r} appears twice in one buffer; register its "
                             "slices in separate buffers")
        seen.add(s.name)
        if any(d <= 0 for d in s.sizes) or any(d <= 0 for d in s.global_shape):
            raise ValueError(f"tensor {s.name!r} is empty ({s.sizes}); leave it out")
        if s.refit_dtype is None:
            dtypes.to_refit(s.dtype)  # fail early on dtypes refit does not carry
    return out


def layout(slices: Sequence[Slice], alignment: int) -> Tuple[List[SliceLayout], int]:
    """Places the slices back to back, each at a multiple of `alignment`; returns the size."""
    layouts, end = [], 0
    for s in slices:
        start = -(-end // alignment) * alignment
        nbytes = math.prod(s.sizes) * torch.empty((), dtype=s.dtype).element_size()
        layouts.append(SliceLayout(s.name, s.dtype, s.global_shape, s.offsets, s.sizes, start,
                                   nbytes, s.refit_dtype, s.scale_tensor, s.scale_block))
        end = start + nbytes
    return layouts, end


def typed_view(region_bytes: torch.Tensor, lay: SliceLayout) -> torch.Tensor:
    flat = region_bytes.narrow(0, lay.buffer_offset, lay.nbytes)
    return flat.view(lay.dtype).view(lay.sizes)


class Buffer:
    """A region registered with the daemon, and torch views of the slices it holds.

    `tensors[name]` views the region (shape: the slice's sizes, dtype: the buffer's): write a
    SOURCE buffer's tensors before `publish`; read a DESTINATION buffer's after `apply`.
    Use as a context manager, or call `release()`: the daemon stops using the memory and this
    process lets it go (closes the memfd, or unlinks the shm object).
    """

    def __init__(self, client, model: str, role: int, buffer_id: str, region,
                 layouts: List[SliceLayout]):
        self._client = client
        self.model = model
        self.role = role
        self.buffer_id = buffer_id
        self.region = region
        self.layouts: Dict[str, SliceLayout] = {lay.name: lay for lay in layouts}
        # A region without a byte view (an engine's own CUDA parameters) has no tensors here:
        # the engine's parameters are the views.
        self.tensors: Dict[str, torch.Tensor] = {} if region.bytes is None else {
            lay.name: typed_view(region.bytes, lay) for lay in layouts}
        self.released = False

    @property
    def memory(self) -> str:
        """"host" or "cuda"."""
        return self.region.memory

    @property
    def host_memory(self) -> Optional[str]:
        """"memfd" (a sealed memfd passed to refitd, the default) or "shm" (a named POSIX shm
        object) for a host buffer; None for CUDA."""
        return self.region.kind if self.region.memory == "host" else None

    @property
    def shm_name(self) -> Optional[str]:
        """The shm_open name of a buffer in a named shm object, e.g.
        "/refit-1234-llama-source-0"; None for a memfd or CUDA buffer."""
        return self.region.name

    @property
    def nbytes(self) -> int:
        return self.region.size

    @torch.no_grad()
    def copy_from(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copies each slice's values in from `tensors` (whole tensors, or this slice's part).

        With strict=False, names missing from `tensors` are left as they are.
        """
        for name, lay in self.layouts.items():
            src = tensors.get(name)
            if src is None:
                if strict:
                    raise KeyError(f"{name} (in buffer {self.buffer_id}) is not in the tensors")
                continue
            self.tensors[name].copy_(self._part(lay, src))

    @torch.no_grad()
    def copy_to(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copies each slice's values out into `tensors` (whole tensors, or this slice's part)."""
        for name, lay in self.layouts.items():
            dst = tensors.get(name)
            if dst is None:
                if strict:
                    raise KeyError(f"{name} (in buffer {self.buffer_id}) is not in the tensors")
                continue
            self._part(lay, dst).copy_(self.tensors[name])

    @staticmethod
    def _part(lay: SliceLayout, tensor: torch.Tensor) -> torch.Tensor:
        shape = tuple(tensor.shape)
        if shape == lay.global_shape:
            return lay.region_of(tensor)
        if shape == lay.sizes:
            return tensor
        raise ValueError(f"{lay.name}: shape {shape} is neither the global shape "
                         f"{lay.global_shape} nor the slice's {lay.sizes}")

    @torch.no_grad()
    def bind(self, module: torch.nn.Module) -> None:
        """Makes `module`'s parameters and buffers of these names live in this region.

        Each parameter keeps its identity (optimizers still hold it) but its data becomes the
        view, so Apply writes straight into the model and a trainer's steps land in the region
        without a copy. The region's current values win. Needs whole tensors of the same dtype
        and device; tied parameters (one tensor under two names) must be registered once.
        """
        bound: Dict[int, str] = {}
        for name, lay in self.layouts.items():
            if not lay.whole:
                raise ValueError(f"{name}: cannot bind a partial slice {lay.sizes} of "
                                 f"{lay.global_shape}; use copy_to")
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if owner._parameters.get(attr) is not None:
                current = owner._parameters[attr]
            elif owner._buffers.get(attr) is not None:
                current = owner._buffers[attr]
            else:
                raise KeyError(f"{name} is neither a parameter nor a buffer of the module")
            view = self.tensors[name]
            if (current.shape != view.shape or current.dtype != view.dtype
                    or current.device != view.device):
                raise ValueError(
                    f"{name}: the module's {tuple(current.shape)} {current.dtype} on "
                    f"{current.device} differs from the buffer's {tuple(view.shape)} "
                    f"{view.dtype} on {view.device}")
            if id(current) in bound:
                raise ValueError(f"{name} and {bound[id(current)]} are one tied tensor; "
                                 "register it under one name")
            bound[id(current)] = name
            if attr in owner._parameters:
                current.data = view
            else:
                owner._buffers[attr] = view

    def release(self) -> None:
        """Tells the daemon to stop using this memory, then frees it. Idempotent."""
        if self.released:
            return
        self.released = True
        try:
            self._client.release_buffer(self.buffer_id)
        finally:
            self.tensors = {}
            self.region.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return (f"<refit.Buffer {self.buffer_id} model={self.model!r} "
                f"{refit_pb2.Role.Name(self.role)} {self.region.describe()}, "
                f"{len(self.layouts)} tensors{state}>")
