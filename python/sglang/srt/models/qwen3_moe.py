"""Qwen3-MoE: attention with per-head RMSNorm on q and k (before rotary), no shared expert.

Experts are `mlp.experts.{e}.gate_proj/up_proj/down_proj`; router as Qwen2-MoE (softmax
top-k, renormalised with `norm_topk_prob`). `attention_bias` covers q/k/v and o.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.experts import SparseMoeBlock
from sglang.srt.layers.moe.router import RouterConfig
from sglang.srt.layers.rotary_embedding import apply_rotary
from sglang.srt.models.llama import LlamaAttention, LlamaMLP
from sglang.srt.models.moe_common import MoECausalLM
from sglang.srt.models.qwen2_moe import is_sparse_layer


class Qwen3MoeAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, bias, bias, getattr(config, "sliding_window", None))
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos_sin, fb) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q = apply_rotary(q, cos_sin, self.num_heads, self.head_dim, inplace=True)  # fresh from the norms
        k = apply_rotary(k, cos_sin, self.num_kv_heads, self.head_dim, inplace=True)
        return self.o_proj(self.attn(q, k, v.contiguous(), fb))


class Qwen3MoeForCausalLM(MoECausalLM):
    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return Qwen3MoeAttention(config, layer_id)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        router = RouterConfig(num_experts=num_experts, top_k=config.num_experts_per_tok,
                              renormalize=bool(config.norm_topk_prob))
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, router, layer_id,
                              self.num_slots)


EntryClass = Qwen3MoeForCausalLM
