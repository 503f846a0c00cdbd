"""What a trainer rank publishes of each tensor of its module, shared by the layouts of
refit.torch.publisher (`layout="hf"`: refit.torch; `layout="megatron"`: refit.megatron):

- `Entry`: one parameter or persistent buffer as this rank holds it, with the boxes of the
  published tensors it holds (`View`s of its local data);
- the checks of one tensor (`check_tensor`) and where a DTensor's local shard lies in its global
  tensor (`place`: Shard, Replicate and _StridedShard placements, uneven shards);
- the published names (`default_name`, `rename_fn`) and whether two boxes overlap (`overlap`).

Imported by refit.torch and refit.megatron; neither imports the other for these.
"""

import itertools
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from refit import dtypes

# Module wrappers that insert a path segment which the checkpoint names do not have.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

Rename = Union[None, Mapping[str, Optional[str]], Callable[[str], Optional[str]]]


class View:
    """A box of a published tensor that lies in a parameter's local storage: `sizes` elements
    of `global_shape` from `offsets`, starting `start` elements into the (contiguous) local
    tensor, with element `strides` (empty: row-major)."""

    __slots__ = ("name", "global_shape", "offsets", "sizes", "start", "strides", "publishes")

    def __init__(self, name: str, global_shape, offsets, sizes, start: int = 0,
                 strides: Sequence[int] = ()):
        self.name = name
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offsets = tuple(int(d) for d in offsets)
        self.sizes = tuple(int(d) for d in sizes)
        self.start = int(start)
        self.strides = tuple(int(d) for d in strides)
        self.publishes = True

    def contiguous_strides(self) -> Tuple[int, ...]:
        out, step = [], 1
        for d in reversed(self.sizes):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """This view of the local tensor (which must be contiguous)."""
        flat = local.reshape(-1)
        return flat.as_strided(self.sizes, self.strides or self.contiguous_strides(),
                               flat.storage_offset() + self.start)

    def box(self, dtype: str) -> Tuple:
        return (self.name, dtype, self.global_shape, self.offsets, self.sizes)

    def __repr__(self) -> str:
        return (f"View({self.name}, global {list(self.global_shape)}, offsets "
                f"{list(self.offsets)}, sizes {list(self.sizes)}, start {self.start}, strides "
                f"{list(self.strides)})")


def dtensor_type():
    """torch's DTensor class, or None where this torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4 keeps it under torch.distributed._tensor
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def default_name(fqn: str) -> str:
    """The checkpoint name of a module path: wrapper segments (torch.compile's `_orig_mod`,
    activation checkpointing's `_checkpoint_wrapped_module`) left out."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS)


@dataclass
class Entry:
    """One tensor of the module, as this rank holds it."""

    fqn: str                      # where it lives in the module
    name: str                     # the name it is published under
    owner: nn.Module
    attr: str
    is_param: bool
    tensor: torch.Tensor          # the parameter/buffer object
    dtensor: bool = False
    fsdp: object = None           # FSDP2's FSDPParam
    global_shape: Tuple[int, ...] = ()
    offsets: Tuple[int, ...] = ()
    sizes: Tuple[int, ...] = ()
    publishes: bool = False       # this rank publishes a part of it
    ptr: int = 0                  # where its local data lived when registered
    # The boxes it publishes, as views of its local data (layout="hf": the one box above;
    # layout="megatron": one per Hugging Face tensor part, refit.megatron).
    views: List[View] = field(default_factory=list)
    local_shape: Tuple[int, ...] = ()

    def local(self) -> torch.Tensor:
        return self.tensor._local_tensor if self.dtensor else self.tensor

    def parts(self) -> List[View]:
        if not self.views:
            self.views = [View(self.name, self.global_shape, self.offsets, self.sizes)]
            self.views[0].publishes = self.publishes
        return self.views

    def published(self) -> List[View]:
        return [v for v in self.parts() if v.publishes]

    def box(self) -> Tuple:
        return (self.name, str(self.local().dtype), self.global_shape, self.offsets, self.sizes)


def rename_fn(rename: Rename) -> Callable[[str], Optional[str]]:
    """`rename` (None, a mapping or a callable) as a function of the name."""
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        return lambda name: rename.get(name, name)
    if callable(rename):
        return rename
    raise TypeError(f"rename must be a mapping or a callable, not {type(rename).__name__}")


def check_tensor(e: Entry, rank: int) -> Optional[str]:
    what = f"rank {rank}: parameter {e.fqn}" if e.is_param else f"rank {rank}: buffer {e.fqn}"
    local = e.local()
    if not isinstance(local, torch.Tensor) or type(local) not in (torch.Tensor, nn.Parameter):
        return (f"{what} is a {type(local).__name__}, neither a torch.Tensor nor a DTensor of "
                "plain tensors; refit cannot read its bytes")
    if local.device.type not in ("cpu", "cuda"):
        return f"{what} lives on {local.device}, neither CPU nor CUDA memory"
    try:
        dtypes.to_refit(local.dtype)
    except (KeyError, ValueError, TypeError):
        return f"{what} has dtype {local.dtype}, which refit does not carry"
    return None


def place(e: Entry, rank: int) -> Optional[str]:
    """This rank's box of the tensor (global shape, offsets, sizes) and whether it publishes."""
    local = e.local()
    if not e.dtensor:
        e.global_shape = tuple(local.shape)
        e.offsets = (0,) * local.dim()
        e.sizes = tuple(local.shape)
        e.publishes = local.numel() > 0  # a claim: the ranks' exchange keeps one replica
        return None
    from torch.distributed.tensor import Replicate, Shard
    spec = e.tensor._spec
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    e.global_shape = tuple(e.tensor.shape)
    if coordinate is None:  # this rank is not on the tensor's mesh
        return None
    try:  # FSDP2 over TP on one dimension; packed gate/up (transformers' packed_colwise)
        from torch.distributed.tensor.placement_types import _StridedShard as Strided
    except ImportError:
        Strided = Shard
    for dim, p in enumerate(spec.placements):
        if not isinstance(p, (Shard, Replicate, Strided)):
            return (f"rank {rank}: parameter {e.fqn} has placement {type(p).__name__} ({p}) on "
                    f"mesh dimension {dim}; "
                    "refit publishes Shard(d) and Replicate() (reduce a Partial first, e.g. "
                    "redistribute to Replicate or Shard)")
    e.local_shape = tuple(local.shape)
    views = _dtensor_views(e.name, e.global_shape, tuple(local.shape), mesh, spec.placements,
                           coordinate, (Shard, Strided))
    if isinstance(views, str):
        return (f"rank {rank}: parameter {e.fqn}: its local tensor is {tuple(local.shape)}, "
                f"but its placements {spec.placements} give {views}")
    replica = any(isinstance(p, Replicate) and coordinate[dim] != 0
                  for dim, p in enumerate(spec.placements))
    e.publishes = not replica and local.numel() > 0
    e.offsets, e.sizes = views[0].offsets, views[0].sizes
    if len(views) > 1:  # e.g. _StridedShard: several boxes, strided views of the local tensor
        for v in views:
            v.publishes = e.publishes
        e.views = views
    return None


def _runs(indices: List[int]) -> List[Tuple[int, int, int]]:
    """(global start, local start, length) of the runs of consecutive global indices."""
    runs: List[Tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == index:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, local, 1))
    return runs


def _dtensor_views(name, global_shape, local_shape, mesh, placements, coordinate, shards):
    """This rank's boxes of a DTensor: per tensor dimension, the global indices its local
    tensor holds, in order (each Shard / _StridedShard placement applied to an index tensor by
    torch's own splitting, mesh dimension by mesh dimension), cut into runs; one box per
    combination of runs, a view of the (row-major) local tensor. A string where the local
    tensor's shape disagrees."""
    per_dim = []
    for d, size in enumerate(global_shape):
        shape = [1] * len(global_shape)
        shape[d] = size
        index = torch.arange(size).view(shape)
        for i, p in enumerate(placements):
            if isinstance(p, shards) and p.dim == d:
                pieces, _ = p._split_tensor(index, mesh.size(i), with_padding=False)
                index = pieces[coordinate[i]] if coordinate[i] < len(pieces) else index[:0]
        per_dim.append(index.reshape(-1).tolist())
    got = tuple(len(i) for i in per_dim)
    if got != tuple(local_shape):
        return str(got)
    strides, step = [], 1
    for d in reversed(local_shape):
        strides.append(step)
        step *= d
    strides = tuple(reversed(strides))
    if any(n == 0 for n in got):
        return [View(name, global_shape, (0,) * len(got), got)]
    views = []
    for combo in itertools.product(*[_runs(i) for i in per_dim]):
        offsets = tuple(c[0] for c in combo)
        sizes = tuple(c[2] for c in combo)
        start = sum(c[1] * st for c, st in zip(combo, strides))
        views.append(View(name, global_shape, offsets, sizes, start,
                          strides if len(combo) and sizes != tuple(local_shape) else ()))
    return views


def overlap(a, b) -> bool:
    """Whether two boxes, each (offsets, sizes), share an element."""
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))
