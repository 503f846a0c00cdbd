"""SGLang's own model classes built on the CPU from small Hugging Face configs (no weights, no
GPU), for test_sglang.py. Runs in the SGLang overlay environment (requirements-sglang.txt,
scripts/install/install-python-env.sh): SGLang 0.5.23's distributed state on gloo (its
`init_distributed_environment` / `initialize_model_parallel`, the topology published from a
ServerArgs as its own layer tests do) and its ModelRegistry's class for each architecture,
constructed as its model loader constructs it (`cls(config, quant_config)`), with its
Fp8Config for fp8 block quantization. The configs are the vLLM tests' (vllm_models.py), so both
engines are checked on the same models.

Every parameter is zeroed after construction (SGLang allocates with torch.empty), so that
padding rows no checkpoint tensor writes compare equal between two instances.
"""

import os
import socket
from typing import List, Optional

# SGLang points its and FlashInfer's JIT caches at ~/.cache/sglang, read-only in Bazel's sandbox.
if os.environ.get("TEST_TMPDIR"):
    os.environ.setdefault("SGLANG_CACHE_DIR",
                          os.path.join(os.environ["TEST_TMPDIR"], "sglang-cache"))

import torch  # noqa: E402

import vllm_models as vm  # noqa: E402  # the configs and checkpoints; imports no vLLM itself

LOADER = "refit.sglang.custom_weight_loader"  # what --custom-weight-loader lists


def init(custom_weight_loader: Optional[List[str]] = None) -> None:
    """SGLang's process state for a TP 1 worker on gloo, with the server's
    --custom-weight-loader list published as its ServerArgs (what ModelRunner hands to its
    WeightUpdater)."""
    from sglang.srt.distributed.parallel_state import (init_distributed_environment,
                                                       initialize_model_parallel,
                                                       model_parallel_is_initialized)
    from sglang.test.test_utils import publish_build_topology
    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    publish_build_topology(tp_size=1, ep_size=1, pp_size=1,
                           custom_weight_loader=custom_weight_loader or [LOADER])
    initialize_model_parallel(backend="gloo")


def build(kind: str, fp8: bool = False) -> torch.nn.Module:
    """SGLang's model class for the config of `kind` (vllm_models.hf_config), bf16; zeroed."""
    import transformers
    from sglang.srt.models.registry import ModelRegistry
    cfg = vm.hf_config(kind)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if k != "architectures"})
    quant = None
    if fp8:
        from sglang.srt.layers.quantization.fp8 import Fp8Config
        quant = Fp8Config.from_config(vm.fp8_block_quantization())
    cls = ModelRegistry.resolve_model_cls(cfg["architectures"])[0]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = cls(config, quant_config=quant)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def weight_updater(model: torch.nn.Module):
    """SGLang's own WeightUpdater (what ModelRunner.update_weights_from_tensor calls) for
    `model`, with the custom weight loaders of the published ServerArgs."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater)
    from sglang.srt.runtime_context import get_model

    def nothing(*args, **kwargs):
        return None
    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None,
                         custom_weight_loaders=get_model().custom_weight_loader,
                         get_model=lambda: model, update_model_fields=nothing,
                         recapture_cuda_graph=nothing, get_model_runner=nothing)


def derived(model: torch.nn.Module):
    """Tensors SGLang derives from the weights after loading that are not parameters
    (DeepSeek's MLA `w_kc` / `w_vc`, from kv_b_proj in post_load_weights)."""
    out = {}
    for name, module in model.named_modules():
        for attr in ("w_kc", "w_vc"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                out[f"{name}.{attr}"] = t
    return out
