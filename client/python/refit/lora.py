"""LoRA adapters as refit models: `refit.lora.publisher(client, model, module, base_model=...)`.

An adapter (its A and B matrices per target module, its rank, alpha and target names) is a
refit model of its own, next to the base model: its versions go through refitd like any
model's (deltas, relays, verification, retention, rollback), and its metadata rides with each
version as the version's labels (`PublishRequest.labels`, at most 1 KiB with the trainer's
own):

    lora.rank, lora.alpha   the adapter's rank r and alpha (scaling = alpha / r)
    lora.targets            the target module names, comma-separated (peft's target_modules:
                            every base module whose name ends with one is adapted)
    lora.base_model         the refit model the adapter belongs to
    lora.dtype              the dtype of A and B as published

The tensors are named as peft saves them (`adapter_model.safetensors`), the names vLLM's and
SGLang's LoRA loaders parse: `base_model.model.<module>.lora_A.weight` ([r, in_features]) and
`...lora_B.weight` ([out_features, r]).

Trainer:

    import refit, refit.lora
    pub = refit.lora.publisher(client, "policy-lora", model, base_model="policy")
    for step in range(1, steps + 1):
        train_step()                      # only A and B change
        pub.publish(step, labels={"step": step})
    pub.release()

`module` is a peft model (`get_peft_model`: LoraLayer modules with `lora_A` / `lora_B`
ModuleDicts, the adapter `adapter_name`) or any torch module whose adapted layers carry
`lora_A` and `lora_B` (nn.Linear or Parameter) and `lora_alpha` (or pass `alpha`). Only A and
B are registered (through refit.torch.publisher: FSDP2 / TP DTensors, CPU memfd re-homing,
CUDA IPC), the base weights stay out (publish them as the base model, refit.torch.publisher).

Bad input, refused before anything is registered or published: a target that names no
module of the base model, a target module left unadapted or an adapted module outside the
targets, A matrices of different ranks (refit.InvalidArgumentError); another rank or other
targets than the adapter model's newest version on this node (refit.FailedPreconditionError:
a rank change is a new adapter model); labels over 1 KiB with the adapter's metadata
(refit.InvalidArgumentError, nothing published).

Engine: refit.vllm.adapter(...) (refit.vllm_lora) loads each version into vLLM's LoRA slots.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from refit import errors

PEFT_PREFIX = "base_model.model."
MAX_LABEL_BYTES = 1024  # daemon/rl/labels.h kMaxLabelBytes
LABELS = ("lora.rank", "lora.alpha", "lora.targets", "lora.base_model", "lora.dtype")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise errors.InvalidArgumentError(f"LoRA matrices of dtype {dtype}: refit.lora carries "
                                      f"{', '.join(_DTYPES)}", what="refit.lora")


def label_bytes(labels: Mapping[str, str]) -> int:
    return sum(len(str(k).encode()) + len(str(v).encode()) for k, v in labels.items())


@dataclass(frozen=True)
class AdapterConfig:
    """An adapter's metadata, as its versions' labels carry it."""

    rank: int
    alpha: float
    targets: Tuple[str, ...]
    base_model: str
    dtype: str = "bfloat16"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def labels(self) -> Dict[str, str]:
        return {"lora.rank": str(self.rank), "lora.alpha": repr(float(self.alpha)),
                "lora.targets": ",".join(self.targets), "lora.base_model": self.base_model,
                "lora.dtype": self.dtype}

    @classmethod
    def from_labels(cls, labels: Mapping[str, str], where: str = "") -> "AdapterConfig":
        missing = [k for k in LABELS if k not in labels]
        if missing:
            raise errors.FailedPreconditionError(
                f"{where}: the version carries no LoRA metadata ({', '.join(missing)} missing "
                "from its labels): not a version refit.lora.publisher published",
                what="refit.lora")
        try:
            rank = int(labels["lora.rank"])
            alpha = float(labels["lora.alpha"])
        except ValueError:
            raise errors.InvalidArgumentError(
                f"{where}: lora.rank={labels['lora.rank']!r} / lora.alpha="
                f"{labels['lora.alpha']!r} are not numbers", what="refit.lora") from None
        if labels["lora.dtype"] not in _DTYPES or rank < 1:
            raise errors.InvalidArgumentError(
                f"{where}: lora.rank {rank}, lora.dtype {labels['lora.dtype']!r}",
                what="refit.lora")
        targets = tuple(t for t in labels["lora.targets"].split(",") if t)
        return cls(rank, alpha, targets, labels["lora.base_model"], labels["lora.dtype"])

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def peft_names(module_path: str) -> Tuple[str, str]:
    """The published names of a module's A and B (peft's checkpoint names)."""
    path = module_path[len(PEFT_PREFIX):] if module_path.startswith(PEFT_PREFIX) else module_path
    return (f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight")


def _matrix(holder, adapter_name: str) -> Optional[torch.Tensor]:
    if isinstance(holder, nn.ModuleDict):
        holder = holder[adapter_name] if adapter_name in holder else None
    if isinstance(holder, nn.Module):
        return getattr(holder, "weight", None)
    return holder if isinstance(holder, torch.Tensor) else None


@dataclass
class _Adapted:
    path: str  # the module's path in the base model (peft's wrapper prefix left out)
    a: torch.Tensor
    b: torch.Tensor
    alpha: Optional[float]


def find_adapted(module: nn.Module, adapter_name: str = "default") -> List[_Adapted]:
    """Every module of `module` holding LoRA matrices (lora_A / lora_B)."""
    out = []
    for path, m in module.named_modules():
        if not hasattr(m, "lora_A") or not hasattr(m, "lora_B"):
            continue
        a, b = _matrix(m.lora_A, adapter_name), _matrix(m.lora_B, adapter_name)
        if a is None or b is None:
            continue
        alpha = getattr(m, "lora_alpha", None)
        if isinstance(alpha, Mapping):  # peft: one per adapter
            alpha = alpha.get(adapter_name)
        base = path[len(PEFT_PREFIX):] if path.startswith(PEFT_PREFIX) else path
        out.append(_Adapted(base, a, b, None if alpha is None else float(alpha)))
    return out


def _base_paths(module: nn.Module) -> List[str]:
    """The module paths of the base model (LoRA's own submodules and peft's wrapper left out)."""
    out = []
    for path, _ in module.named_modules():
        parts = path.split(".")
        if any(p in ("lora_A", "lora_B", "lora_dropout", "lora_embedding_A",
                     "lora_embedding_B", "lora_magnitude_vector") for p in parts):
            continue
        if path.startswith(PEFT_PREFIX):
            path = path[len(PEFT_PREFIX):]
        if path.endswith(".base_layer"):  # peft's wrapped original layer
            continue
        out.append(path)
    return out


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def adapter_config(module: nn.Module, base_model: str, *, rank: Optional[int] = None,
                   alpha: Optional[float] = None, targets: Optional[Iterable[str]] = None,
                   adapter_name: str = "default") -> Tuple[AdapterConfig, List[_Adapted]]:
    """The adapter `module` holds, checked (refit.InvalidArgumentError naming what is wrong)."""
    what = "refit.lora"
    adapted = find_adapted(module, adapter_name)
    if not adapted:
        raise errors.InvalidArgumentError("the module holds no LoRA matrices (no submodule "
                                          "with lora_A and lora_B)", what=what)
    ranks = sorted({int(x.a.shape[0]) for x in adapted} | {int(x.b.shape[-1]) for x in adapted})
    if len(ranks) != 1 or (rank is not None and ranks != [rank]):
        raise errors.InvalidArgumentError(
            f"the adapter's A/B matrices have rank(s) {ranks}"
            + (f", not the rank {rank} given" if rank is not None else "")
            + ": one adapter has one rank", what=what)
    alphas = sorted({x.alpha for x in adapted if x.alpha is not None})
    if alpha is None:
        if len(alphas) != 1:
            raise errors.InvalidArgumentError(
                f"alpha: the adapted modules carry lora_alpha {alphas or 'nowhere'}; pass "
                "alpha=", what=what)
        alpha = alphas[0]
    dtypes = {x.a.dtype for x in adapted} | {x.b.dtype for x in adapted}
    if len(dtypes) != 1:
        raise errors.InvalidArgumentError(f"A and B in dtypes {sorted(map(str, dtypes))}: one "
                                          "dtype per adapter", what=what)
    paths = [x.path for x in adapted]
    if targets is None:
        targets = sorted({p.rsplit(".", 1)[-1] for p in paths})
    targets = tuple(targets)
    base = _base_paths(module)
    for t in targets:
        if not t or "," in t:
            raise errors.InvalidArgumentError(f"target {t!r}: not a module name", what=what)
        if not any(_matches(p, t) for p in base):
            raise errors.InvalidArgumentError(
                f"target {t!r} names no module of the base model (its modules end in "
                f"{sorted({p.rsplit('.', 1)[-1] for p in base if p})[:12]}...)", what=what)
    outside = [p for p in paths if not any(_matches(p, t) for t in targets)]
    if outside:
        raise errors.InvalidArgumentError(
            f"adapted module(s) {outside[:3]} match no target of {list(targets)}", what=what)
    adapted_set = set(paths)
    # peft's rule: every module whose name ends with a target is adapted (the engine derives
    # the adapter's tensors from the targets); only leaves with a weight count.
    leaves = {p for p, m in module.named_modules() if hasattr(m, "weight")
              and not list(m.children())}
    unadapted = [p for p in base if p not in adapted_set and any(_matches(p, t) for t in targets)
                 and (p in leaves or PEFT_PREFIX + p in leaves)]
    if unadapted:
        raise errors.InvalidArgumentError(
            f"module(s) {unadapted[:3]} match the targets {list(targets)} but carry no LoRA "
            "matrices", what=what)
    config = AdapterConfig(ranks[0], float(alpha), targets, base_model,
                           _dtype_name(dtypes.pop()))
    size = label_bytes(config.labels())
    if size > MAX_LABEL_BYTES:
        raise errors.InvalidArgumentError(
            f"the adapter's metadata takes {size} bytes of the {MAX_LABEL_BYTES} a version's "
            "labels may hold", what=what)
    return config, adapted


def newest_labels(client, model: str) -> Tuple[int, Dict[str, str]]:
    """(version, labels) of the newest version of `model` this node knows labels for."""
    for m in client.status().models:
        if m.model == model and m.version_labels:
            newest = max(m.version_labels, key=lambda v: v.version)
            return newest.version, dict(newest.labels)
    return 0, {}


def check_against_newest(client, model: str, config: AdapterConfig) -> None:
    """refit.FailedPreconditionError when the adapter model's newest version on this node has
    another rank, targets or base model than `config` (a rank change is a new adapter model)."""
    version, labels = newest_labels(client, model)
    if not version or "lora.rank" not in labels:
        return
    old = AdapterConfig.from_labels(labels, f"model {model} version {version}")
    for field, mine, theirs in (("rank", config.rank, old.rank),
                                ("targets", config.targets, old.targets),
                                ("base model", config.base_model, old.base_model),
                                ("dtype", config.dtype, old.dtype)):
        if mine != theirs:
            raise errors.FailedPreconditionError(
                f"adapter model {model}: {field} {mine!r}, but its version {version} on this "
                f"node has {field} {theirs!r}; an adapter keeps its shape across versions: "
                "publish it as a new adapter model (or `refitctl drop` this one first)",
                what="refit.lora")


class AdapterPublisher:
    """A LoRA adapter registered as SOURCE buffers of its own refit model; see the module
    docstring and `publisher()`."""

    def __init__(self, client, model: str, config: AdapterConfig, publisher):
        self.client = client
        self.model = model
        self.config = config
        self.publisher = publisher  # refit.torch.Publisher of the A and B matrices

    @property
    def names(self) -> List[str]:
        return self.publisher.names

    def publish(self, version: int, timeout: Optional[float] = None, *,
                labels: Optional[Dict[str, str]] = None, max_staleness: int = 0,
                run: Optional[str] = None):
        """Snapshots the adapter's A and B as `version`, its metadata in the version's labels
        (with `labels`: the trainer's own, together at most 1 KiB, else
        refit.InvalidArgumentError and nothing published)."""
        merged = {str(k): str(v) for k, v in (labels or {}).items()}
        clash = sorted(k for k in merged if k.startswith("lora."))
        if clash:
            raise errors.InvalidArgumentError(f"labels {clash}: the lora.* labels are the "
                                              "adapter's own", what="refit.lora")
        merged.update(self.config.labels())
        size = label_bytes(merged)
        if size > MAX_LABEL_BYTES:
            raise errors.InvalidArgumentError(
                f"labels of {size} bytes with the adapter's metadata "
                f"({label_bytes(self.config.labels())} bytes of it) are more than the "
                f"{MAX_LABEL_BYTES} a version may carry; nothing was published",
                what="refit.lora")
        return self.publisher.publish(version, timeout, labels=merged,
                                      max_staleness=max_staleness, run=run)

    def release(self) -> None:
        self.publisher.release()

    def __enter__(self) -> "AdapterPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def publisher(client, model: str, module: nn.Module, *, base_model: str,
              rank: Optional[int] = None, alpha: Optional[float] = None,
              targets: Optional[Iterable[str]] = None, adapter_name: str = "default",
              group=None, client_name: Optional[str] = None, check_peers: bool = True,
              run: str = "") -> AdapterPublisher:
    """Registers the LoRA matrices of `module` as SOURCE slices of the adapter model `model`
    (the adapter of the refit model `base_model`); returns the AdapterPublisher
    (`publish(version, labels=...)`, `release()`).

    `rank`, `alpha`, `targets` (peft's target_modules): read from the module where not given,
    checked against it where given. Collective across the trainer's ranks, as
    refit.torch.publisher."""
    from refit import torch as refit_torch
    config, adapted = adapter_config(module, base_model, rank=rank, alpha=alpha,
                                     targets=targets, adapter_name=adapter_name)
    check_against_newest(client, model, config)
    fqn_of = {id(p): refit_torch.default_name(n) for n, p in module.named_parameters()}
    table: Dict[str, str] = {}
    for x in adapted:
        a_name, b_name = peft_names(x.path)
        for tensor, name in ((x.a, a_name), (x.b, b_name)):
            fqn = fqn_of.get(id(tensor))
            if fqn is None:
                raise errors.InvalidArgumentError(
                    f"{name}: the LoRA matrix of {x.path} is not a parameter of the module",
                    what="refit.lora")
            table[fqn] = name
    inner = refit_torch.publisher(client, model, module, rename=table.get, group=group,
                                  client_name=client_name, check_peers=check_peers, run=run)
    return AdapterPublisher(client, model, config, inner)
