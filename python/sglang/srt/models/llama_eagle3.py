"""EAGLE-3 draft head in upstream's checkpoint format (`LlamaForCausalLMEagle3`).

One decoder layer that reads the target's own features (docs/eagle_formats.md):
- the first draft step takes the target's hidden states after three of its layers,
  concatenated [T, 3 * Ht], projected by `fc` to [T, H]; later steps feed back the head's
  own output [T, H] (no `fc`);
- the layer's attention reads [input_layernorm(embedding of the token), hidden_norm(h)]
  side by side ([T, 2H]: q / k / v take 2H inputs), its residual is h;
- `norm` then `lm_head` give logits over the draft vocabulary (`draft_vocab_size`); draft
  id i is target id i + d2t[i].
The embedding is the target's (checkpoints carry none): `set_embed` before the first
forward. Checkpoint names: `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`,
`d2t` (and `t2d`, a mask over the target vocabulary the head does not need), bare or under
`model.`. The capture of the target's layers is `aux_hidden_layers`.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.attention.radix_attention import RadixAttention
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import Linear
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.rotary_embedding import (RotaryEmbedding, apply_rotary,
                                                rope_parameters_from_config)
from sglang.srt.models.llama import head_dim_of, load_into

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch import ForwardBatch


def aux_hidden_layers(config: PretrainedConfig, target_layers: int) -> List[int]:
    """Target layers whose output hidden states feed `fc`, ascending (the concatenation's
    order): the head's `eagle_config.eagle_aux_hidden_state_layer_ids`, else upstream's
    default [1, L // 2 - 1, L - 4]."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [1, target_layers // 2 - 1, target_layers - 4]
    ids = sorted(int(i) for i in ids)
    if len(ids) != 3 or ids[0] < 0 or ids[-1] >= target_layers:
        raise ValueError(f"EAGLE-3 needs three target layers in 0..{target_layers - 1}, got {ids}")
    return ids


class Eagle3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, self.head_dim, heads,
                                          getattr(config, "num_key_value_heads", None) or heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.num_kv_heads, layer_id=0)

    def forward(self, x: torch.Tensor, cos_sin, fb: "ForwardBatch") -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q, cos_sin, self.num_heads, self.head_dim, inplace=True)
        k = apply_rotary(k, cos_sin, self.num_kv_heads, self.head_dim, inplace=True)
        return self.o_proj(self.attn(q, k, v.contiguous(), fb))


class Eagle3Layer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps)  # the token's embedding
        self.hidden_norm = RMSNorm(h, eps=eps)  # the features
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.mlp = GatedMLP(h, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin,
                fb: "ForwardBatch") -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, cos_sin, fb)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x) + residual


class LlamaForCausalLMEagle3(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or h
        self.fc = Linear(3 * target_h, h, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters_from_config(config))
        self.embed_tokens: Optional[nn.Module] = None  # the target's (set_embed)

    def set_embed(self, embed: nn.Module) -> None:
        self.embed_tokens = embed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch",
                hidden: torch.Tensor, from_target: bool = True
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits over the draft vocabulary at fb's logits rows, the head's output
        [T, H] for the next step). `hidden`: the target's three layers [T, 3 * Ht] when
        `from_target`, else the head's own output of the previous step."""
        assert self.embed_tokens is not None, "set_embed(the target's embedding) first"
        embeds = self.embed_tokens(input_ids)
        if from_target:
            hidden = self.fc(hidden)
        cos_sin = self.rotary_emb.cos_sin(positions, embeds.dtype)
        out = self.midlayer(embeds, hidden.to(embeds.dtype), cos_sin, fb)
        rows = fb.resolved_logits_indices()
        return self.lm_head(self.norm(out[rows])).float(), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- weights -------------------------------------------------------------------------

    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    _FUSED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Upstream's names into the fused parameters; raise on unknown or missing ones."""
        params: Dict[str, torch.Tensor] = dict(self.named_parameters())
        params["d2t"] = self.d2t  # optional: zeros (draft id = target id) without it
        self.d2t.zero_()  # built on the meta device: no values until loaded
        pending = {(n, s) for n in params if n != "d2t"
                   for s in range(3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1)}
        for name, tensor in weights:
            name = name[len("model."):] if name.startswith("model.") else name
            if name in ("t2d", "embed_tokens.weight") or "rotary_emb.inv_freq" in name:
                continue  # the target's mask and embedding; rotary from the config
            target, shard = name, 0
            m = self._FUSED_RE.search(name)
            if m is not None:
                fused, shard = self._FUSED[m.group(1)]
                target = name.replace(m.group(1), fused)
            if target not in params:
                raise KeyError(f"EAGLE-3 checkpoint tensor {name!r} has no place in the head "
                               "(upstream's names: fc, midlayer.*, norm, lm_head, d2t)")
            if target == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
            else:
                owner, leaf = target.rsplit(".", 1)
                load_into(self.get_submodule(owner), leaf, params[target], tensor, shard, name)
            pending.discard((target, shard))
        if ("lm_head.weight", 0) in pending:
            raise ValueError("EAGLE-3 checkpoint has no lm_head.weight: heads that share the "
                             "target's head (draft_vocab_size null) are not supported yet")
        if pending:
            missing = sorted({n for n, _ in pending})
            raise ValueError(f"EAGLE-3 checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def read_head_folder(folder: str, arch: str, kind: str):
    """(LlamaConfig, an iterator of (name, tensor)) of an upstream-format head folder
    (config.json + *.safetensors) whose architectures name `arch`."""
    from safetensors import safe_open
    from transformers import LlamaConfig

    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    if arch not in raw.get("architectures", []):
        raise ValueError(f"{folder}: not an {kind} head (architectures {raw.get('architectures')})")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights")

    def tensors():
        for name in files:
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    return LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}), tensors()


def load_eagle3_head(folder: str, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> LlamaForCausalLMEagle3:
    """The head of an upstream-format folder (config.json + *.safetensors)."""
    config, tensors = read_head_folder(folder, "LlamaForCausalLMEagle3", "EAGLE-3")
    head = LlamaForCausalLMEagle3(config)
    head.load_weights(tensors)
    return head.to(device=device, dtype=dtype)
