"""DeepSeek-V2 / V3: multi-head latent attention (MLA) + MoE with shared experts.

Attention keeps one latent per token in the KV pool (`mem_cache/mla_pool.py`): the
normalised `c_kv` [kv_lora_rank] and the rotated shared key `k_pe` [qk_rope_head_dim].
Queries are absorbed into latent space (`q_nope @ W_UK`), attention runs on the backend as
one-KV-head attention over the latents (`layers/attention/mla_attention.py`), and the
result leaves latent space through W_UV, then o_proj. Algebraically this is HF's expanded
form (k = [W_UK c_kv | k_pe], v = W_UV c_kv), without materialising per-head K/V.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)... (V2 always; V3 when
`rope_interleave`); we de-interleave q_pe and k_pe the same way before a rotate-half
rotation, which leaves every q.k product unchanged. Rope types other than default / linear /
llama3 (DeepSeek's yarn) take their frequencies from transformers' rope functions.

FFN: the first `first_k_dense_replace` layers are dense; the others route (V2: softmax,
greedy or group-limited top-k; V3: sigmoid + correction bias, grouped top-k, renormalised)
and add `n_shared_experts` shared experts. Weights times `routed_scaling_factor`.
Not supported: `mlp_bias` (no released checkpoint uses it). V3's MTP layer is skipped
here; models/deepseek_nextn.py serves it as a draft head (NEXTN).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.distributed.parallel_state import divide, tp_group
from sglang.srt.layers.attention.mla_attention import mla_attention
from sglang.srt.layers.attention.radix_attention import RadixAttention
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.experts import SparseMoeBlock
from sglang.srt.layers.moe.router import RouterConfig
from sglang.srt.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.rotary_embedding import (SUPPORTED_ROPE_TYPES, compute_inv_freq,
                                                rope_parameters_from_config)
from sglang.srt.models.llama import LlamaMLP
from sglang.srt.models.moe_common import MoECausalLM


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class DeepseekRotary(nn.Module):
    """cos / sin [T, qk_rope_head_dim] in float32 (rotate-half layout), with yarn's
    attention factor folded in as transformers does."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        params = rope_parameters_from_config(config)
        dim = config.qk_rope_head_dim
        if params["rope_type"] in SUPPORTED_ROPE_TYPES:
            self._inv_freq = compute_inv_freq(dim, params, config.max_position_embeddings)
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
            self._inv_freq = inv_freq.float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self._inv_freq  # [T, dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, heads, d] -> rotated, in float32 then back to x's dtype."""
    dtype = x.dtype
    x = x.float()
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(dtype)


class DeepseekV2MLA(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, interleaved: bool) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        # Under TP each rank holds its heads' rows of q / kv_b and columns of o; the latent
        # (kv_a) and so the KV pool are whole on every rank, as upstream splits MLA.
        self.num_heads = divide(heads, tp_group().size, "number of attention heads")
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.interleaved = interleaved
        q_out = heads * (self.nope + self.rope)  # rows head by head: an even split is by head
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim),
                                              bias=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        scaling = (self.nope + self.rope) ** -0.5
        params = rope_parameters_from_config(config)
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            scaling *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
        self.attn = RadixAttention(self.num_heads, self.rank + self.rope, scaling, 1, layer_id,
                                   v_head_dim=self.rank)

    def forward(self, hidden: torch.Tensor, cos_sin, fb) -> torch.Tensor:
        t, h = hidden.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [T, r]
        cos, sin = cos_sin
        q_pe = _rope(q_pe, cos, sin, self.interleaved)  # [T, H, rope]
        k_pe = _rope(k_pe.unsqueeze(1), cos, sin, self.interleaved)[:, 0]  # [T, rope]
        w_kv = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope :]  # [H, nope, r], [H, v, r]
        q_abs = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, r]
        q_latent = torch.cat((q_abs, q_pe), dim=-1)  # [T, H, r + rope]
        latent = torch.cat((c_kv, k_pe), dim=-1)  # [T, r + rope]
        out = mla_attention(q_latent, latent, self.attn, fb)  # [T, H, r]
        out = torch.einsum("thr,hvr->thv", out, w_uv).reshape(t, h * self.v_dim)
        return self.o_proj(out)


class DeepseekV2ForCausalLM(MoECausalLM):
    interleaved_rope = True

    def make_rotary(self, config: PretrainedConfig) -> nn.Module:
        return DeepseekRotary(config)

    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return DeepseekV2MLA(config, layer_id, self.rope_interleaved(config))

    @classmethod
    def rope_interleaved(cls, config: PretrainedConfig) -> bool:
        return True

    @classmethod
    def router_config(cls, config: PretrainedConfig) -> RouterConfig:
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        return RouterConfig(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                            num_groups=config.n_group if grouped else None,
                            topk_group=config.topk_group if grouped else None,
                            scaling_factor=float(config.routed_scaling_factor), fp32_logits=True)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return deepseek_ffn(config, layer_id, self.router_config(config), self.num_slots)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def rope_interleaved(cls, config: PretrainedConfig) -> bool:
        return bool(getattr(config, "rope_interleave", True))

    @classmethod
    def router_config(cls, config: PretrainedConfig) -> RouterConfig:
        return RouterConfig(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                            scoring="sigmoid", renormalize=bool(config.norm_topk_prob),
                            num_groups=config.n_group, topk_group=config.topk_group,
                            group_score="top2_sum", correction_bias=True,
                            scaling_factor=float(config.routed_scaling_factor), fp32_logits=True)


def deepseek_ffn(config: PretrainedConfig, layer_id: int, router: RouterConfig,
                 num_slots=None, block_layer_id=None) -> nn.Module:
    """Checkpoint layer `layer_id`'s FFN: dense below `first_k_dense_replace`, else routed
    experts plus the shared ones (`block_layer_id`: the id the MoE block reports under)."""
    if layer_id < (getattr(config, "first_k_dense_replace", 0) or 0):
        return LlamaMLP(config.hidden_size, config.intermediate_size)
    shared = config.moe_intermediate_size * (getattr(config, "n_shared_experts", 0) or 0)
    return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, router,
                          layer_id if block_layer_id is None else block_layer_id, num_slots,
                          shared_intermediate_size=shared, shared_name="shared_experts")


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
