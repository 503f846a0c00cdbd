"""Publishing straight from a torch 2.x model: `refit.torch.publisher(client, model, module)`.

    import refit, refit.torch
    pub = refit.torch.publisher(refit.Client(), "policy", model)   # after fully_shard / TP
    for step in range(1, steps + 1):
        train_step()
        pub.publish(step)                                # a snapshot of this rank's part
    pub.release()

The publisher derives this rank's SOURCE slices from the module's parameters and persistent
buffers, under their `state_dict()` names (the Hugging Face names engines load; `rename` maps
them otherwise):
- plain tensors: the whole tensor, published by rank 0 of the process group (they are the same
  on every rank: data parallel, or norms left unsharded by tensor parallelism);
- DTensors (FSDP2 `fully_shard`, `parallelize_module`, both on a 2-D mesh): the rows/columns
  `Shard(d)` gives this rank, uneven last shards included (FSDP2 pads dim 0 of its shards:
  the padding is never published); on a `Replicate()` mesh dimension only the rank at
  coordinate 0 publishes; `Partial` is refused.

Memory: refitd reads a SOURCE from memory it can map, so CPU parameters are moved once into one
sealed memfd per publisher (values kept; each parameter object stays the same, so optimizers are
unaffected; FSDP2's padded shard and its unpadded view both point into it). Optimizer steps then
write straight into what refitd snapshots: `publish` copies nothing in this process. Where
something re-allocates a parameter later (FSDP2's lazy init, `load_state_dict(assign=True)`,
`module.to()`), `publish` sees the parameter's storage moved and re-homes it before publishing
(logged). CUDA parameters are registered where they are, through a CUDA IPC handle of the
cudaMalloc block holding them (one buffer per block).

Checks, before anything is registered or published, on every rank at once (the ranks exchange
their slices over a gloo group): a parameter that is neither a tensor nor a DTensor of plain
tensors, a dtype refit does not carry, a `Partial` placement, a rename mapping two parameters
to one name, two ranks claiming the same elements, a tensor whose elements no rank publishes;
and at each `publish`, a rank publishing another version than its peers. Each is a
`PublisherError` naming the parameter and the rank.

Not thread-safe: the training loop's thread drives a Publisher.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from refit import buffer as buffer_lib
from refit import memory
from refit.entries import WRAPPER_SEGMENTS  # noqa: F401 (refit.torch.WRAPPER_SEGMENTS, as before)
from refit.entries import (Entry, Rename, View, check_tensor, default_name, dtensor_type, overlap,
                           place, rename_fn)
from refit.v1 import refit_pb2

log = logging.getLogger("refit.torch")

ALIGNMENT = 64
_Entry = Entry  # its name here before refit.entries held it


class PublisherError(ValueError):
    """A module refit cannot publish as given; raised on every rank before anything is
    registered (or, from publish(), before anything is published)."""


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _fsdp_params(module: nn.Module) -> Dict[int, object]:
    """id(sharded parameter) -> FSDP2's FSDPParam holding it (its padded `_sharded_param_data`
    shares the parameter's storage)."""
    out: Dict[int, object] = {}
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
                # A parameter replaced since fully_shard (a checkpoint loaded with assign=True,
                # as transformers' from_pretrained does after sharding) is FSDP2's until its
                # lazy init adopts it (reset_sharded_param): found by where it lives.
                info = getattr(fp, "_module_info", None)
                current = getattr(info.module, info.param_name, None) if info else None
                if current is not None:
                    out[id(current)] = fp
    return out


def _collect(module: nn.Module, rename: Rename, rank: int, errors: List[str]) -> List[Entry]:
    """Every parameter and persistent buffer once (a tied tensor under its first name)."""
    DTensor = dtensor_type()
    fsdp = _fsdp_params(module)
    renamed = rename_fn(rename)
    seen: Dict[int, str] = {}
    named: Dict[str, str] = {}
    out: List[Entry] = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        items = [(a, t, True) for a, t in m._parameters.items()]
        items += [(a, t, False) for a, t in m._buffers.items()
                  if a not in m._non_persistent_buffers_set]
        for attr, tensor, is_param in items:
            if tensor is None:
                continue
            fqn = f"{prefix}.{attr}" if prefix else attr
            if id(tensor) in seen:
                log.debug("refit.torch: %s is %s (tied); published once, as %s", fqn,
                          seen[id(tensor)], seen[id(tensor)])
                continue
            seen[id(tensor)] = fqn
            name = renamed(default_name(fqn))
            if name is None:
                continue
            if not isinstance(name, str) or not name:
                errors.append(f"rank {rank}: rename gave {name!r} for parameter {fqn}")
                continue
            if name in named:
                errors.append(f"rank {rank}: rename maps parameters {named[name]} and {fqn} "
                              f"to one name {name!r}")
                continue
            named[name] = fqn
            is_dtensor = DTensor is not None and isinstance(tensor, DTensor)
            out.append(Entry(fqn, name, m, attr, is_param, tensor, is_dtensor,
                              fsdp.get(id(tensor))))
    return out


def check_boxes(boxes_by_rank: Sequence[Sequence[Tuple]],
                ranks: Optional[Sequence[int]] = None) -> List[str]:
    """Problems with what the ranks publish together: [(name, dtype, global_shape, offsets,
    sizes)] per rank. Two ranks claiming the same elements, disagreeing on a tensor's shape or
    dtype, or leaving elements of it unpublished."""
    problems: List[str] = []
    tensors: Dict[str, List[Tuple[int, Tuple]]] = {}
    for index, boxes in enumerate(boxes_by_rank):
        rank = ranks[index] if ranks is not None else index
        for box in boxes:
            tensors.setdefault(box[0], []).append((rank, box))
    for name, claims in tensors.items():
        first_rank, first = claims[0]
        for rank, box in claims[1:]:
            if box[1:3] != first[1:3]:
                problems.append(f"parameter {name}: rank {first_rank} has {first[1]} "
                                f"{list(first[2])}, rank {rank} has {box[1]} {list(box[2])}")
        for i, (ra, a) in enumerate(claims):
            for rb, b in claims[i + 1:]:
                if overlap((a[3], a[4]), (b[3], b[4])):
                    problems.append(
                        f"parameter {name}: rank {ra} and rank {rb} both claim the shard at "
                        f"offsets {list(b[3])} sizes {list(b[4])} (rank {ra}: offsets "
                        f"{list(a[3])} sizes {list(a[4])}); one rank per shard publishes")
        covered = sum(math.prod(b[4]) for _, b in claims)
        whole = math.prod(first[2])
        if covered != whole and not problems:
            problems.append(f"parameter {name}: the ranks publish {covered} of its {whole} "
                            "elements; the rest would never arrive")
    return problems


def _digest(t: torch.Tensor) -> str:
    """A digest of a tensor's values (its bytes), to tell replicas from clashing claims."""
    import hashlib
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


def _agree(entries: List[Entry], errors: List[str], rank: int, group) -> List[str]:
    """The ranks exchange their claims (and errors): every rank raises the same errors.

    Identical claims by several ranks (plain tensors, replicated by data or tensor parallelism;
    DTensors on a sub-mesh, replicated across the others, e.g. FSDP2's shards of the norms on
    every TP rank) are replicas when their values agree: the lowest rank publishes. With other
    values they are two ranks claiming the same shard, an error."""
    dist = _dist()
    size = dist.get_world_size(group)
    gathered: List[Optional[Tuple]] = [None] * size
    mine: Dict[Tuple, Tuple[Entry, View]] = {}
    labels: Dict[Tuple, str] = {}
    for e in entries:
        for v in e.published():
            box = v.box(str(e.local().dtype))
            mine[box] = (e, v)
            labels[box] = e.fqn
    dist.all_gather_object(gathered, (rank, list(mine), errors, labels), group=group)
    errors = [err for _, _, errs, _ in gathered for err in errs]
    if errors:
        return errors
    claimants: Dict[Tuple, List[int]] = {}
    for r, boxes, _, _ in gathered:
        for box in boxes:
            claimants.setdefault(box, []).append(r)
    shared = {box: ranks for box, ranks in claimants.items() if len(ranks) > 1}
    digests = {box: _digest(mine[box][1].of(mine[box][0].local()))
               for box in shared if box in mine}
    everyone: List[Optional[Tuple]] = [None] * size
    dist.all_gather_object(everyone, (rank, digests), group=group)
    by_rank = dict(everyone)
    label_of = {r: lab for r, _, _, lab in gathered}
    for box, ranks in shared.items():
        values = {r: by_rank[r][box] for r in ranks}
        if len(set(values.values())) > 1:
            sources = sorted({label_of[r][box] for r in ranks} - {box[0]})
            origin = f" (from {', '.join(sources)})" if sources else ""
            errors.append(f"parameter {box[0]}{origin}: ranks {ranks} all claim the shard at "
                          f"offsets {list(box[3])} sizes {list(box[4])} with different values; "
                          "one rank per shard publishes (replicas must be equal)")
        elif rank in ranks and rank != min(ranks):
            mine[box][1].publishes = False  # a replica: the lowest rank publishes it
    if errors:
        return errors
    unique = {}
    for r, boxes, _, _ in gathered:
        unique[r] = [b for b in boxes if min(claimants[b]) == r]
    return check_boxes([unique[r] for r in sorted(unique)], ranks=sorted(unique))


class CudaSourceRegion(memory.CudaIpcBlock):
    """Part of a cudaMalloc block holding the trainer's CUDA parameters, registered in place;
    the trainer's allocator owns it."""

    bytes = None

    def __init__(self, device: int, handle: bytes, offset: int, size: int, device_uuid: str):
        self._set_block(device, handle, offset, size, device_uuid)

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return (f"cuda:{self.device} trainer parameters ({self.size} bytes at offset "
                f"{self.offset} of an IPC block)")


def cuda_regions(entries: Sequence[Entry], block_of: Optional[Callable] = None,
                 uuid_of: Optional[Callable[[int], str]] = None
                 ) -> List[Tuple[CudaSourceRegion, List[buffer_lib.SliceLayout]]]:
    """One region per cudaMalloc block holding the entries' local data, spanning them, with
    each entry's layout relative to it. `block_of(tensor)` -> (device, handle, block address);
    the default asks torch (memory.torch_cuda_block), tests pass fakes."""
    block_of = block_of or memory.torch_cuda_block  # looked up now: tests patch it
    if uuid_of is None:
        def uuid_of(device: int) -> str:
            return memory.gpu_uuid(torch.cuda.get_device_properties(device))
    blocks: Dict[Tuple[int, bytes], List[Tuple[int, Entry, int]]] = {}
    for e in entries:
        local = e.local()
        if not local.is_contiguous():
            raise PublisherError(f"parameter {e.fqn}: its CUDA local tensor is not contiguous")
        device, handle, base = block_of(local)
        nbytes = local.numel() * local.element_size()
        blocks.setdefault((device, handle), []).append((local.data_ptr() - base, e, nbytes))
    out = []
    for (device, handle), members in blocks.items():
        lo = min(at for at, _, _ in members)
        hi = max(at + n for at, _, n in members)
        region = CudaSourceRegion(device, handle, lo, hi - lo, uuid_of(device))
        out.append((region, [lay for at, e, n in members for lay in _layouts(e, at - lo)]))
    return out


@dataclass(frozen=True)
class StridedLayout(buffer_lib.SliceLayout):
    """A slice whose elements lie at `strides` (elements) from its buffer_offset."""

    strides: Tuple[int, ...] = ()

    def to_proto(self):
        proto = super().to_proto()
        proto.buffer_strides.extend(self.strides)
        return proto


def _layouts(e: Entry, offset: int) -> List[buffer_lib.SliceLayout]:
    """The slices of what this entry publishes, its local data at `offset` in the buffer."""
    local = e.local()
    size = local.element_size()
    out: List[buffer_lib.SliceLayout] = []
    for v in e.published():
        nbytes = math.prod(v.sizes) * size
        at = offset + v.start * size
        if v.strides and v.strides != v.contiguous_strides():
            out.append(StridedLayout(v.name, local.dtype, v.global_shape, v.offsets, v.sizes,
                                     at, nbytes, strides=v.strides))
        else:
            out.append(buffer_lib.SliceLayout(v.name, local.dtype, v.global_shape, v.offsets,
                                              v.sizes, at, nbytes))
    return out


def _trim_heap() -> None:
    """Returns the heap pages the re-homed parameters' old storage held to the system (glibc
    keeps freed small and mid-sized blocks mapped), so re-homing does not grow the trainer's
    resident memory by its shard."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Publisher:
    """This rank's part of a module, registered with refitd as SOURCE buffers; see the module
    docstring and `publisher()`."""

    def __init__(self, client, model: str, module: nn.Module, entries: List[Entry],
                 group, rank: int, client_name: str, check_peers: bool, run: str = ""):
        self.client = client
        # The trainer's run (PublishRequest.run): a trainer resuming from a checkpoint names a
        # new one, and may publish steps below those the old run published; "" : the model's
        # current run.
        self.run = run
        self.model = model
        self.module = module
        self.rank = rank
        self._entries = [e for e in entries if e.published()]
        self._group = group
        self._client_name = client_name
        self._check_peers = check_peers
        self.buffers: List[buffer_lib.Buffer] = []
        self.rehomes = 0          # times parameters had moved and were registered again
        # Seconds spent making it: "checks" (collecting, the ranks' exchange), "rehome" (moving
        # CPU parameters into the memfd), "register" (refitd's RegisterBuffer, which warms
        # --retain + 1 version slots of the buffer's size), "register_cuda".
        self.timings: Dict[str, float] = {}
        self.released = False
        self._register()

    @property
    def names(self) -> List[str]:
        """The names this rank publishes (parts of), in registration order."""
        return list(dict.fromkeys(v.name for e in self._entries for v in e.published()))

    def slices(self) -> List[Tuple]:
        """(name, dtype, global_shape, offsets, sizes) of each slice this rank publishes."""
        return [v.box(str(e.local().dtype)) for e in self._entries for v in e.published()]

    # ---- registering ----

    def _register(self) -> None:
        cpu = [e for e in self._entries if e.local().device.type == "cpu"]
        cuda = [e for e in self._entries if e.local().device.type == "cuda"]
        clock = time.perf_counter
        try:
            if cpu:
                t0 = clock()
                region, layouts = self._rehome_cpu(cpu)
                t1 = clock()
                self.buffers.append(self.client.register_region(
                    self.model, refit_pb2.SOURCE, region, layouts,
                    client_name=self._client_name))
                self.timings["rehome"] = t1 - t0
                self.timings["register"] = clock() - t1
            t0 = clock()
            for region, layouts in cuda_regions(cuda):
                self.buffers.append(self.client.register_region(
                    self.model, refit_pb2.SOURCE, region, layouts,
                    client_name=self._client_name))
            if cuda:
                self.timings["register_cuda"] = clock() - t0
        except BaseException:
            self._release_buffers()
            raise
        for e in self._entries:
            e.ptr = self._pointer(e)
        if cpu:
            _trim_heap()

    def _rehome_cpu(self, entries: List[Entry]):
        """Moves the entries' local data into one new sealed memfd; returns it and layouts."""
        slots, end = [], 0
        for e in entries:
            local = e.local()
            count = (math.prod(e.fsdp.padded_sharded_param_size) if e.fsdp is not None
                     else local.numel())
            start = -(-end // ALIGNMENT) * ALIGNMENT
            slots.append(start)
            end = start + count * local.element_size()
        region = memory.MemfdRegion(max(end, 1), label=f"refit-{self.model}-rank{self.rank}")
        layouts = []
        with torch.no_grad():
            for e, start in zip(entries, slots):
                local = e.local()
                nbytes = local.numel() * local.element_size()
                if e.fsdp is not None:
                    size = e.fsdp.padded_sharded_param_size
                    flat = region.bytes.narrow(0, start, math.prod(size) * local.element_size())
                    flat = flat.view(local.dtype)
                    shaped = flat.view(size)
                    dim = e.fsdp.fsdp_placement.dim
                    held = e.fsdp._sharded_param_data
                    if (held.is_meta or held.untyped_storage().data_ptr()
                            != local.untyped_storage().data_ptr()):
                        # A parameter FSDP2 has not adopted yet (loaded after fully_shard): its
                        # values, padded with the memfd's zeros; lazy init then keeps them here.
                        shaped.narrow(dim, 0, local.shape[dim]).copy_(local)
                    else:
                        flat.copy_(held)
                    e.fsdp._sharded_param_data = flat
                    e.tensor._local_tensor = shaped.narrow(dim, 0, local.shape[dim])
                else:
                    view = region.bytes.narrow(0, start, nbytes).view(local.dtype)
                    view = view.view(local.shape)
                    view.copy_(local)
                    if e.dtensor:
                        e.tensor._local_tensor = view
                    elif e.is_param:
                        e.tensor.data = view
                    else:
                        e.owner._buffers[e.attr] = view
                        e.tensor = view
                layouts.extend(_layouts(e, start))
        return region, layouts

    @staticmethod
    def _pointer(e: Entry) -> int:
        return e.local().data_ptr()

    def _moved(self) -> List[str]:
        """Entries whose storage is no longer what was registered."""
        moved = []
        for e in self._entries:
            current = (e.owner._parameters if e.is_param else e.owner._buffers).get(e.attr)
            if current is not e.tensor:
                moved.append(f"{e.fqn} (replaced)")
            elif self._pointer(e) != e.ptr or (
                    e.fsdp is not None and e.fsdp._sharded_param_data.data_ptr() != e.ptr):
                moved.append(e.fqn)
        return moved

    # ---- the public methods ----

    def publish(self, version: int, timeout: Optional[float] = None, *,
                labels: Optional[Dict[str, str]] = None, max_staleness: int = 0,
                run: Optional[str] = None):
        """Snapshots this rank's part as `version` (refitd copies it before this returns);
        returns the PublishResponse (None on a rank that holds nothing to publish).

        `labels` and `max_staleness`: as `refit.Client.publish` (the trainer's metadata for the
        version, delivered with it to the engines; a staleness budget to wait for).
        `run` (default: the publisher's `run`) names the trainer's run; a new one restarts the
        version numbers and is remembered for the next publishes."""
        if run is not None:
            self.run = run
        if self.released:
            raise PublisherError(f"rank {self.rank}: publish({version}) after release()")
        if self._check_peers and self._group is not None:
            dist = _dist()
            versions: List[Optional[int]] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(versions, int(version), group=self._group)
            if len(set(versions)) != 1:
                others = {r: v for r, v in enumerate(versions) if v != version}
                raise PublisherError(
                    f"model {self.model}: rank {self.rank} publishes version {version} but "
                    f"rank(s) {sorted(others)} publish {sorted(set(others.values()))} "
                    f"(versions by rank: {versions}); nothing was published")
        moved = self._moved()
        if moved:
            log.info("refit.torch: rank %d: %d parameter(s) were re-allocated since they were "
                     "registered (e.g. %s); registering them again", self.rank, len(moved),
                     ", ".join(moved[:3]))
            fsdp = _fsdp_params(self.module)
            for e in self._entries:
                e.tensor = (e.owner._parameters if e.is_param else e.owner._buffers)[e.attr]
                if e.fsdp is not None:
                    e.fsdp = fsdp.get(id(e.tensor))
                local = e.local()
                if tuple(local.shape) != (e.local_shape or e.sizes):
                    raise PublisherError(
                        f"rank {self.rank}: parameter {e.fqn} is now {tuple(local.shape)}, "
                        f"registered as {e.local_shape or e.sizes}; make a new publisher")
            self._release_buffers()
            self._register()
            self.rehomes += 1
        if not self.buffers:
            return None
        if labels or max_staleness:
            return self.client.publish(self.model, version, self.buffers, labels=labels,
                                       max_staleness=max_staleness, run=self.run)
        return self.client.publish(self.model, version, self.buffers, run=self.run)

    def _release_buffers(self) -> None:
        buffers, self.buffers = self.buffers, []
        for b in buffers:
            b.release()

    def release(self) -> None:
        """Releases what this publisher registered. The parameters keep their values (a CPU
        parameter stays in its memfd mapping until it is freed). Idempotent."""
        if not self.released:
            self.released = True
            self._release_buffers()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"<refit.torch.Publisher model={self.model!r} rank {self.rank}: "
                f"{len(self._entries)} tensors in {len(self.buffers)} buffer(s)>")


def publisher(client, model: str, module: nn.Module, *, layout: str = "hf",
              rename: Rename = None, group=None, client_name: Optional[str] = None,
              check_peers: bool = True, vocab_size: Optional[int] = None,
              run: str = "") -> Publisher:
    """Registers this rank's part of `module` as SOURCE slices of `model`; returns the
    Publisher (`publish(version)`, `release()`).

    Call it on every rank of the trainer at once (it is collective: the ranks check their
    slices together), after the model is sharded (fully_shard, parallelize_module).
    `rename`: a mapping or a function from the `state_dict()` name to the published one (None:
    leave the tensor out).
    `layout="megatron"`: `module` is a megatron-core GPTModel (or the list of a virtual
    pipeline's chunks, or either inside Megatron's DDP/Float16Module wrappers), published under
    the Hugging Face names (refit.megatron has the table; `rename` then maps those names, and
    names a Megatron parameter the table does not know, or leaves it out with None);
    `vocab_size`: the Hugging Face vocabulary, where Megatron padded its embedding rows. `group`: the process group of the trainer's ranks (default: the
    whole world, through a gloo group made for these checks where the default backend is not
    gloo). `check_peers=False` skips the cross-rank checks (and the small gloo exchange in each
    publish). `run`: the trainer's run
    (PublishRequest.run): a trainer resumed from a checkpoint at an older step passes a new
    run (e.g. f"{job}-resume@{step}") and publishes from that step on; engines' nodes follow it
    without a manual `refitctl drop`.
    """
    if layout not in ("hf", "megatron"):
        raise ValueError(f"refit.torch.publisher: layout={layout!r}: 'hf' or 'megatron'")
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    started = time.perf_counter()
    errors: List[str] = []
    if layout == "megatron":
        from refit import megatron
        entries = megatron.collect(module, rename, rank, errors, vocab_size)
        if dist and not check_peers and dist.get_world_size() > 1:
            errors.append(f"rank {rank}: layout='megatron' needs check_peers=True on more than "
                          "one rank (the exchange picks one rank per replicated tensor)")
    else:
        entries = _collect(module, rename, rank, errors)
        for e in entries:
            problem = check_tensor(e, rank) or place(e, rank)
            if problem:
                errors.append(problem)
    if not entries and not errors:
        errors.append(f"rank {rank}: the module has no parameters or persistent buffers")
    if dist and check_peers and dist.get_world_size() > 1:
        if group is None:
            group = (dist.group.WORLD if dist.get_backend() == "gloo"
                     else dist.new_group(backend="gloo"))
        errors = _agree(entries, errors, rank, group)
    else:
        group = None
        if dist and rank != 0:  # no exchange: plain tensors are rank 0's to publish
            for e in entries:
                if not e.dtensor:
                    e.publishes = False
                    for v in e.views:
                        v.publishes = False
    if errors:
        raise PublisherError(f"refit.torch.publisher(model={model!r}): "
                             + "; ".join(errors))
    checks = time.perf_counter() - started
    pub = Publisher(client, model, module, entries, group, rank, client_name or f"rank{rank}",
                    check_peers, run)
    pub.timings["checks"] = checks
    return pub
