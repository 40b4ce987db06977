"""Llama (and the Llama-shaped Qwen2 / Mistral): fused projections, RadixAttention.

q/k/v share one Linear (`qkv_proj`, rows [q | k | v]) and gate/up share one (`gate_up_proj`,
rows [gate | up]): one GEMM each, which is what makes CPU decode fast. `load_weights` takes
Hugging Face checkpoint names and copies each shard into its rows of the fused parameter.
Invariant: after `load_weights` every parameter has been written (the model is built on the
meta device, so an unwritten parameter would be garbage); a missing one raises.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.attention.radix_attention import RadixAttention
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.mlp import GatedMLP
# Linears split over the TP ranks (plain Linear at one rank), whose CPU forward uses
# sgl_kernel's small-row kernel: decode, verify trees and small chunks cost alike.
from sglang.srt.layers.parallel_linear import (ParallelLMHead, QKVParallelLinear,
                                               RowParallelLinear, VocabParallelEmbedding)
from sglang.srt.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_rotary,
    rope_parameters_from_config,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch import ForwardBatch

CosSin = Tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


LlamaMLP = GatedMLP  # upstream's name for the Llama FFN


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, qkv_bias: bool, o_bias: bool,
                 sliding_window: Optional[int] = None) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads,
                                          getattr(config, "num_key_value_heads", None) or heads,
                                          bias=qkv_bias)
        # this rank's heads (all of them at one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.num_kv_heads, layer_id, sliding_window=sliding_window)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, fb: "ForwardBatch") -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # in place: q and k are this call's slices of qkv
        q = apply_rotary(q, cos_sin, self.num_heads, self.head_dim, inplace=True)
        k = apply_rotary(k, cos_sin, self.num_kv_heads, self.head_dim, inplace=True)
        out = self.attn(q, k, v.contiguous(), fb)  # [T, q_size]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, qkv_bias: bool, o_bias: bool,
                 sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_id = layer_id

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], cos_sin: CosSin,
                fb: "ForwardBatch") -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (layer output, residual); their sum is the HF hidden state after the layer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if fb.residual_hook is not None:  # a draft feeding the target's expert prefetch
            fb.residual_hook(self.layer_id, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool,
                 sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, sliding_window)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters_from_config(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: "ForwardBatch") -> Tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual), each [T, hidden_size], before the final norm."""
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        capture = fb.capture_layers  # an EAGLE-3 head reads three layers' outputs
        taken: Dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos_sin, fb)
            if capture and i in capture:
                taken[i] = hidden + residual  # the layer's output hidden state
        if capture:
            fb.captured_hidden = torch.cat([taken[i] for i in capture], dim=-1)
        return hidden, residual


# HF name pieces that land in rows of a fused parameter: piece -> (fused piece, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True  # heads, FFN and vocabulary split (parallel_linear.py)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias, o_bias, self.sliding_window(config))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> Tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj); Llama's `attention_bias` covers both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def sliding_window(config: PretrainedConfig) -> Optional[int]:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """float32 logits [len(resolved_logits_indices), vocab]; norm + lm_head run only on
        those rows, so a long prefill pays for one vocab projection per request."""
        hidden, residual = self.model(input_ids, positions, forward_batch)
        rows = forward_batch.resolved_logits_indices()
        hidden = self.model.norm(hidden[rows] + residual[rows])
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; raise on unknown or missing names."""
        if self.tie_word_embeddings:
            # Re-tie: materialising a meta-built model (`to_empty`) unshares parameters.
            self.lm_head.weight = self.model.embed_tokens.weight
        params: Dict[str, nn.Parameter] = dict(self.named_parameters(remove_duplicate=False))
        # Every (param name, shard) that must be written; fused params count each shard.
        pending: Set[Tuple[str, int]] = set()
        for name, p in params.items():
            if name == "lm_head.weight":
                continue  # checked below: tied or loaded
            n_shards = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
            pending.update((name, s) for s in range(n_shards))
        saw_lm_head = False
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight":
                if self.tie_word_embeddings:
                    continue
                saw_lm_head = True
            m = _FUSED_RE.search(name)
            target, shard = name, 0
            if m is not None:
                fused, shard = _FUSED[m.group(1)]
                target = name.replace(m.group(1), fused)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            owner, leaf = target.rsplit(".", 1)
            load_into(self.get_submodule(owner), leaf, params[target], tensor, shard, name)
            pending.discard((target, shard))
        if not saw_lm_head and not self.tie_word_embeddings:
            # Checkpoints without lm_head share the embedding matrix.
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tie_word_embeddings = True
        if pending:
            missing = sorted({n for n, _ in pending})
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def load_into(module: nn.Module, leaf: str, param: torch.Tensor, tensor: torch.Tensor,
              shard: int, name: str) -> None:
    """A whole checkpoint tensor into `module.leaf`: a parallel layer takes its own shard
    (and part of a fused projection), any other parameter is copied whole."""
    if hasattr(module, "load_shard"):
        try:
            module.load_shard(leaf, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        return
    _copy(param, tensor, name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


EntryClass = LlamaForCausalLM
