"""EAGLE (EAGLE-1/2) draft head in upstream's checkpoint format (`LlamaForCausalLMEagle`).

Decoder layers that read the target's final hidden state (docs/eagle_formats.md §1):
- each row: `fc` over [embedding of the token, the target's hidden state after its final
  norm] ([T, 2H] -> [T, H], with a bias; embedding first), then the Llama decoder layers,
  layer 0 without its input norm; the head's output is hidden + residual (no final norm);
- logits come from the target's own lm_head over the whole vocabulary; later draft steps
  feed back the head's output in place of the target's hidden state.
Embedding and lm_head are the target's (`set_embed_and_head`); a checkpoint's own copies
are skipped, as upstream skips them. Checkpoint names: `fc.*`, `layers.{i}.*`, bare or
under `model.`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.linear import Linear
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_config
from sglang.srt.models.llama import _FUSED, _FUSED_RE, LlamaDecoderLayer, head_dim_of, load_into

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch import ForwardBatch


class LlamaEagleModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.fc = Linear(2 * h, h, bias=True)  # upstream's fc always has a bias
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, bias, bias)
                                    for i in range(config.num_hidden_layers))
        # layer 0 reads fc's output as it is (upstream's EAGLE layer 0 has no input norm)
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters_from_config(config))
        self.embed_tokens: Optional[nn.Module] = None  # the target's


class LlamaForCausalLMEagle(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaEagleModel(config)
        self.lm_head: Optional[nn.Module] = None  # the target's

    def set_embed_and_head(self, embed: nn.Module, head: nn.Module) -> None:
        # plain attributes, not submodules: the target owns (and moves) those weights
        self.model.__dict__["embed_tokens"] = embed
        self.__dict__["lm_head"] = head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch",
                hidden: torch.Tensor, from_target: bool = True
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits over the target's vocabulary at fb's logits rows, the head's
        output [T, H]). `hidden`: the target's final hidden state, or the head's own output
        of the previous step; both enter `fc` alike (`from_target` is EAGLE-3's)."""
        assert self.lm_head is not None, "set_embed_and_head(the target's) first"
        m = self.model
        embeds = m.embed_tokens(input_ids)
        x = m.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        cos_sin = m.rotary_emb.cos_sin(positions, embeds.dtype)
        residual = None
        for layer in m.layers:
            x, residual = layer(x, residual, cos_sin, fb)
        out = x + residual
        rows = fb.resolved_logits_indices()
        return self.lm_head(out[rows]).float(), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's vocabulary

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Upstream's names into the fused parameters; raise on unknown or missing ones."""
        params: Dict[str, torch.Tensor] = dict(self.named_parameters())
        pending: Set[Tuple[str, int]] = {
            (n, s) for n in params
            for s in range(3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1)}
        for name, tensor in weights:
            if "lm_head" in name or name.endswith("embed_tokens.weight") \
                    or "rotary_emb.inv_freq" in name:
                continue  # the target's embedding and head; rotary from the config
            name = name if name.startswith("model.") else "model." + name
            target, shard = name, 0
            m = _FUSED_RE.search(name)
            if m is not None:
                fused, shard = _FUSED[m.group(1)]
                target = name.replace(m.group(1), fused)
            if target not in params:
                raise KeyError(f"EAGLE checkpoint tensor {name!r} has no place in the head "
                               "(upstream's names: fc.weight, fc.bias, layers.{i}.*; layer 0 "
                               "has no input_layernorm)")
            owner, leaf = target.rsplit(".", 1)
            load_into(self.get_submodule(owner), leaf, params[target], tensor, shard, name)
            pending.discard((target, shard))
        if pending:
            missing = sorted({n for n, _ in pending})
            raise ValueError(f"EAGLE checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")




def load_eagle_head(folder: str, dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> LlamaForCausalLMEagle:
    """The head of an upstream-format folder (config.json + *.safetensors)."""
    from sglang.srt.models.llama_eagle3 import read_head_folder

    config, tensors = read_head_folder(folder, "LlamaForCausalLMEagle", "EAGLE")
    head = LlamaForCausalLMEagle(config)
    head.load_weights(tensors)
    return head.to(device=device, dtype=dtype)


EntryClass = LlamaForCausalLMEagle
