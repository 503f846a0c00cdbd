"""refit as a receiver of weight updates for an SGLang engine: `receive(version)` pulls a
version by number from the node's refitd and loads it through the model's own
`load_weights(weights: Iterable[tuple[str, Tensor]])`; `destroy()` releases the buffer. The
method names follow the issue's description of SGLang's external weight-update receivers;
SGLang's actual receiver interface was not verified here (SGLang can't be installed, and its
API wasn't found in the reference material), so treat this as the shape, tested only against
a torch model with SGLang's `load_weights` signature (client/python/tests/test_engines.py).
"""

from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from refit import client as client_lib
from refit.engine_sync import EngineWeights, NonFiniteVersionError, weight_version

__all__ = ["RefitWeightReceiver", "NonFiniteVersionError"]


class RefitWeightReceiver:
    def __init__(self, model: torch.nn.Module, model_name: str,
                 params: Dict[str, Tuple[Sequence[int], torch.dtype]],
                 fp8: Iterable[str] = (), fp8_block: Sequence[int] = (128, 128),
                 socket: Optional[str] = None):
        self.model = model
        self.client = client_lib.Client(socket)
        self.weights = EngineWeights(self.client, model_name, params, fp8, fp8_block,
                                     client_name="sglang")

    def receive(self, version: int = 0, timeout: Optional[float] = 60.0,
                refuse_nonfinite: bool = True) -> str:
        """Applies `version` (0: the next one) and returns its weight version string."""
        applied = self.weights.update(self.model.load_weights, version, timeout,
                                      refuse_nonfinite)
        return weight_version(self.weights.model, applied)

    def destroy(self) -> None:
        self.weights.release()
        self.client.close()
