"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (NEXTN), read from the
target's own checkpoint as upstream reads it (docs/eagle_formats.md §3.1).

A row reads the next token beside the target's final hidden state (after its final norm):
    x = eh_proj([enorm(embed(token)), hnorm(hidden)])      # embedding first, no bias
    x = one DeepSeek decoder layer (MLA + routed and shared experts)
    out = shared_head.norm(x + residual)                   # post-norm: logits and feed-back
logits = the target's lm_head(out); later draft steps feed `out` back as `hidden`.

Weights: the checkpoint's layer `num_hidden_layers` (61 for V3) holds the MTP layer:
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a decoder layer under the same prefix;
its `embed_tokens` and `shared_head.head` copies are skipped (the target's are shared), as
is every other tensor. A folder exported as one layer (`num_hidden_layers` 1, upstream's
export script) keeps it under `model.layers.0`. The config is the target's with one layer
(`draft_config`), so the draft's KV pool holds one MLA layer.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import Linear
from sglang.srt.layers.moe.experts import SparseMoeBlock
from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.models.deepseek_v2 import (DeepseekRotary, DeepseekV2MLA, DeepseekV3ForCausalLM,
                                           deepseek_ffn)
from sglang.srt.models.moe_common import MoEDecoderLayer, pending_params, place_tensor

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch import ForwardBatch

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the MTP layer's own tensors
_SHARED = ("embed_tokens.", "shared_head.head.")  # copies of the target's: skipped


def mtp_layer_id(config: PretrainedConfig) -> int:
    """Where the checkpoint keeps the MTP layer: after the target's layers, or layer 0 of
    a one-layer export."""
    return 0 if config.num_hidden_layers == 1 else config.num_hidden_layers


class _SharedHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekNextNModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps=eps)
        self.hnorm = RMSNorm(h, eps=eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        # the MTP layer always routes (upstream's is_nextn), whatever its index
        dense_below = getattr(config, "first_k_dense_replace", 0) or 0
        mlp = deepseek_ffn(config, dense_below, DeepseekV3ForCausalLM.router_config(config),
                           block_layer_id=0)
        attn = DeepseekV2MLA(config, 0, DeepseekV3ForCausalLM.rope_interleaved(config))
        self.decoder = MoEDecoderLayer(config, attn, mlp, "mlp")
        self.decoder.layer_id = 0
        self.shared_head = _SharedHead(config)
        self.rotary_emb = DeepseekRotary(config)
        self.embed_tokens: Optional[nn.Module] = None  # the target's


class DeepseekV3ForCausalLMNextN(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekNextNModel(config)
        self.lm_head: Optional[nn.Module] = None  # the target's

    @staticmethod
    def draft_config(config: PretrainedConfig) -> PretrainedConfig:
        """The target's config as the head's: one layer, remembering where the checkpoint
        keeps it (`nextn_layer_id`)."""
        if config.num_hidden_layers != 1 and not getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("NEXTN: the checkpoint's config has num_nextn_predict_layers 0: "
                             "it carries no multi-token-prediction layer to draft with (use "
                             "--speculative-algorithm NGRAM, or EAGLE/EAGLE3 with a head)")
        config = copy.deepcopy(config)
        config.nextn_layer_id = mtp_layer_id(config)
        config.num_hidden_layers = 1
        config.architectures = ["DeepseekV3ForCausalLMNextN"]
        return config

    def set_embed_and_head(self, embed: nn.Module, head: nn.Module) -> None:
        # plain attributes, not submodules: the target owns (and moves) those weights
        self.model.__dict__["embed_tokens"] = embed
        self.__dict__["lm_head"] = head

    def moe_blocks(self) -> Dict[int, SparseMoeBlock]:
        mlp = self.model.decoder.mlp
        return {0: mlp} if isinstance(mlp, SparseMoeBlock) else {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch",
                hidden: torch.Tensor, from_target: bool = True
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits over the target's vocabulary at fb's logits rows, the head's
        output [T, H]). `hidden`: the target's final hidden state, or the head's own
        output of the previous step; both pass hnorm alike."""
        assert self.lm_head is not None, "set_embed_and_head(the target's) first"
        m = self.model
        # its own step in the expert recorder: the MTP layer's routing is not the target's
        get_expert_recorder().begin_step(input_ids, positions, "nextn")
        embeds = m.embed_tokens(input_ids)
        x = m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(hidden.to(embeds.dtype))], dim=-1))
        cos_sin = m.rotary_emb.cos_sin(positions, x.dtype)
        x, residual = m.decoder(x, None, cos_sin, fb)
        out = m.shared_head.norm(x + residual)
        rows = fb.resolved_logits_indices()
        return self.lm_head(out[rows]).float(), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's vocabulary

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """The MTP layer's tensors of a target checkpoint; raise if any is missing."""
        lid = self.config.nextn_layer_id
        prefix = re.compile(rf"^model\.layers\.{lid}\.")
        params = dict(self.named_parameters())
        pending = pending_params(self, params)
        for name, tensor in weights:
            m = prefix.match(name)
            if m is None:
                continue  # the target's own layers, norm, embedding and head
            rest = name[m.end():]
            if rest.startswith(_SHARED):
                continue
            local = "model." + (rest if rest.startswith(_OWN) else "decoder." + rest)
            pending.discard(place_tensor(self, params, local, tensor))
        if pending:
            missing = sorted({n for n, _ in pending})
            raise ValueError(
                f"NEXTN: the checkpoint has no complete multi-token-prediction layer under "
                f"model.layers.{lid}. ({len(missing)} tensors missing, e.g. {missing[:3]}); "
                "DeepSeek-V3 checkpoints keep it after the last layer (num_nextn_predict_layers)")
        for block in self.moe_blocks().values():
            missing = block.experts.missing_experts()
            if missing:
                raise ValueError(f"NEXTN: the checkpoint lacks MTP layer {lid}'s experts "
                                 f"{missing[:5]}")

EntryClass = DeepseekV3ForCausalLMNextN
