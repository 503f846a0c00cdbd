"""What an engine adapter maps: one checkpoint tensor inside an engine parameter (`Part`), and
the error raised when the mapping and the engine's parameters disagree. Shared by
refit.engine_storage (which writes parts) and refit.engine_probe (which finds them), so neither
imports the other for these.
"""

from dataclasses import dataclass
from typing import Optional, Tuple


class MappingError(ValueError):
    """The mapping and the engine's parameters disagree (parts that don't add up)."""


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside an engine parameter."""

    name: str                     # checkpoint name, as the trainer publishes it
    sizes: Tuple[int, ...]        # its shape
    expert: Optional[int]         # index in the parameter's dim 0 (per-expert parameters)
    row: int                      # first row (dim 0 of the expert, or of the parameter)
    refit_dtype: Optional[int] = None  # FP8_E4M3 for fp8 weights
    scale_tensor: str = ""
    scale_block: Tuple[int, ...] = ()
    # A box of the checkpoint tensor (a tensor-parallel shard; refit.engine_probe): the whole
    # tensor's shape, the box's offsets in it, and the element of the parameter it starts at.
    # Unset: the whole tensor (`sizes`), at `row` (of `expert`).
    global_shape: Tuple[int, ...] = ()
    offsets: Tuple[int, ...] = ()
    element_offset: Optional[int] = None
