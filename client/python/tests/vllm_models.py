"""vLLM's own model classes built on the CPU from small Hugging Face configs (no weights, no
GPU): the installed vllm's ModelConfig / VllmConfig, its tensor-parallel groups on gloo (one
process per TP rank) and `initialize_model`, the same constructor path its model loader takes.
Shared by test_vllm.py, vllm_tp_rank.py and bench_vllm.py.

Every parameter is zeroed after construction (vLLM allocates with torch.empty), so that
padding rows no checkpoint tensor writes compare equal between two instances.
"""

import json
import os
import tempfile
from typing import Dict, Optional

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform; the wheel is CUDA's
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are local files; nothing to fetch

import torch  # noqa: E402

VOCAB = 1000  # not a multiple of 64: vLLM pads its embedding and lm_head rows


def hf_config(kind: str) -> Dict:
    """A small Hugging Face config.json of `kind`: llama, llama_mha, qwen3, qwen3_moe,
    deepseek_v3, deepseek_v3_fp8."""
    common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="bfloat16",
                  tie_word_embeddings=False)
    if kind == "llama":
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama_mha":  # as many KV heads as heads: fp8 block-aligned TP 2 shards
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    if kind == "llama_bench":  # ~66 M parameters (132 MB bf16): bench_vllm.py
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    vocab_size=8000, hidden_size=1024, num_hidden_layers=4,
                    intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16)
    if kind == "qwen3":
        return dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                    intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64)
    if kind == "qwen3_moe":
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True)
    if kind == "deepseek_v3":
        return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                    intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
                    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256,
                    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                    v_head_dim=64, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    if kind == "deepseek_v3_fp8":  # every fused part a whole number of [128, 128] blocks
        return dict(hf_config("deepseek_v3"), kv_lora_rank=256, qk_rope_head_dim=128)
    raise ValueError(kind)


def fp8_block_quantization() -> Dict:
    """DeepSeek-V3's quantization_config: fp8 e4m3 weights with [128, 128] block scales in
    `weight_scale_inv` (vLLM's Fp8Config with weight_block_size)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128]}


class _NoFp8Kernel:
    """Stands in for the fp8 matmul kernel vLLM picks at construction (its CPU kernels need
    AMX; its GPU ones a GPU). Only the matmul: the fp8 parameters, their `weight_scale_inv`
    block scales and their weight loaders are vLLM's own (Fp8LinearMethod.create_weights)."""

    def process_weights_after_loading(self, layer):
        pass

    def apply_weights(self, *args, **kwargs):
        raise RuntimeError("no fp8 matmul kernel on this CPU (tests build, load and compare)")


def without_fp8_kernels() -> None:
    """Lets Fp8LinearMethod build its parameters on a CPU without AMX (test-only)."""
    import vllm.model_executor.layers.quantization.fp8 as fp8
    fp8.init_fp8_linear_kernel = lambda *args, **kwargs: _NoFp8Kernel()


def init_tp(config, rank: int = 0, world: int = 1, port: Optional[int] = None) -> None:
    """vLLM's distributed state for TP `world` on gloo (this process is TP rank `rank`)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    if model_parallel_is_initialized():
        return
    if port is None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(world, 1)


def vllm_config(kind: str, fp8: bool = False, tp: int = 1, directory: Optional[str] = None,
                device: str = "cpu"):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig
    cfg = hf_config(kind)
    if fp8:
        cfg["quantization_config"] = fp8_block_quantization()
        without_fp8_kernels()
    directory = directory or tempfile.mkdtemp(prefix="engines-vllm-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    mc = ModelConfig(model=directory, skip_tokenizer_init=True, dtype="bfloat16",
                     enforce_eager=True)
    return VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"),
                      device_config=DeviceConfig(device),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))


def build(config) -> torch.nn.Module:
    """vLLM's model class for `config`, built as its model loader builds it; zeroed."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    device = torch.device(config.device_config.device)
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), \
            device:
        model = initialize_model(vllm_config=config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def hf_state_dict(kind: str, seed: int, fp8: bool = False) -> Dict[str, torch.Tensor]:
    """The trainer's checkpoint of `kind`: transformers' own model class on the meta device
    gives the names and shapes (bf16), values from `seed`."""
    import transformers
    cfg = hf_config(kind)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        out[name] = (torch.randn(tuple(t.shape), generator=g) * 0.05).to(torch.bfloat16)
    return out


def fp8_names(state: Dict[str, torch.Tensor]):
    """The names an fp8 block-quantized checkpoint holds as fp8 (DeepSeek-V3's rule: the 2-D
    linear weights of the decoder layers, MLA's kv_a_proj_with_mqa included; not embeddings,
    norms, lm_head or the router)."""
    return sorted(n for n, t in state.items()
                  if t.dim() == 2 and ".layers." in n
                  and n.endswith(("_proj.weight", "_proj_with_mqa.weight"))
                  and ".mlp.gate." not in n)
