"""Qwen2-MoE: Qwen2 attention (q/k/v bias) + routed experts + a shared expert whose output
is scaled by sigmoid(x @ shared_expert_gate).

A layer is sparse unless it is listed in `mlp_only_layers` or `(i + 1) % decoder_sparse_step`
is non-zero; dense layers use `intermediate_size`. Router: softmax top-k, renormalised only
with `norm_topk_prob`. The sliding window (`use_sliding_window`) is not applied.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.moe.experts import SparseMoeBlock
from sglang.srt.layers.moe.router import RouterConfig
from sglang.srt.models.llama import LlamaAttention, LlamaMLP
from sglang.srt.models.moe_common import MoECausalLM


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts > 0 and (layer_id + 1) % step == 0)


class Qwen2MoeForCausalLM(MoECausalLM):
    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return LlamaAttention(config, layer_id, bool(getattr(config, "qkv_bias", True)), False)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        router = RouterConfig(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                              renormalize=bool(config.norm_topk_prob))
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, router, layer_id,
                              self.num_slots,
                              shared_intermediate_size=config.shared_expert_intermediate_size or 0,
                              shared_name="shared_expert", shared_gate=True)


EntryClass = Qwen2MoeForCausalLM
