"""What fsdp_trainer.py and fsdp_engine.py share: a tiny Qwen3 (transformers' own model class,
from a config, random weights), the vLLM fused layout the engine keeps its weights in, and a
digest of weights in checkpoint names so the two sides can be compared.
"""

import hashlib
from typing import Mapping

import torch

from refit.mapping import FusedMapping

# How vLLM's Qwen3 fuses the checkpoint tensors (its load_weights' stacked_params_mapping).
VLLM_QWEN3 = FusedMapping(stacked=[("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                                   ("gate_up_proj", ["gate_proj", "up_proj"])])


def config(layers: int = 2, hidden: int = 64):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=101, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hidden // 4, tie_word_embeddings=False,
                       max_position_embeddings=128)


def build(seed: int, **kwargs):
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config(**kwargs))


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A fingerprint of the weights by checkpoint name: equal on both sides when every byte is."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
