"""Mixtral: Llama attention (no biases) + a sparse MoE FFN named `block_sparse_moe`.

Router: softmax over experts, top-k, the k weights renormalised to sum to 1. Checkpoint
experts are `block_sparse_moe.experts.{e}.w1/w3/w2` (gate / up / down). Mixtral's sliding
window is not applied (as for Mistral: outputs match HF within the window).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.moe.experts import SparseMoeBlock
from sglang.srt.layers.moe.router import RouterConfig
from sglang.srt.models.llama import LlamaAttention
from sglang.srt.models.moe_common import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    mlp_name = "block_sparse_moe"

    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, layer_id, bias, bias, getattr(config, "sliding_window", None))

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        router = RouterConfig(num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, renormalize=True)
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, router, layer_id,
                              self.num_slots)


EntryClass = MixtralForCausalLM
