"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) for tests.

Built offline in seconds with transformers, saved with per-expert keys as real checkpoints
are, with SmolLM2's tokenizer (as `fixtures.build_tiny_model`). Each config exercises its
family's quirks: GQA, q/k/v bias, dense layers among sparse ones, a gated shared expert,
q/k norms, MLA with and without q LoRA, group-limited and sigmoid grouped routing with a
non-zero correction bias, routed scaling.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")

_COMMON: Dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.15,
    vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
_ARCH: Dict[str, Dict[str, Any]] = {
    "mixtral": dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=None),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=3, norm_topk_prob=True, head_dim=24),
    "deepseek_v2": dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5),
    "deepseek_v3": dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def tiny_moe_config(arch: str, **overrides: Any):
    from transformers import (DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig,
                              Qwen3MoeConfig)

    classes = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
               "deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config}
    if arch not in classes:
        raise ValueError(f"unknown tiny MoE arch {arch!r}; choose one of {MOE_ARCHS}")
    return classes[arch](**{**_COMMON, **_ARCH[arch], **overrides})


def build_tiny_moe(arch: str, out_dir: str, seed: int = 0, **overrides: Any) -> str:
    """Save a random float32 `arch` model + SmolLM2's tokenizer in `out_dir`; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang.test.fixtures import _TOKENIZER_FILES, smollm2_tokenizer_dir

    config = tiny_moe_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("gate.weight") or "experts" in name:
                p.normal_(0.0, config.initializer_range)  # some inits leave routers at zero
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.05, 0.05)  # make the choice bias matter
    model.save_pretrained(out_dir, safe_serialization=True)
    tok_dir = smollm2_tokenizer_dir(os.path.join(os.path.dirname(os.path.abspath(out_dir)),
                                                 ".tokenizer-cache"))
    for name in _TOKENIZER_FILES:
        src = os.path.join(tok_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))
    return out_dir
