"""EAGLE drafter (EAGLE-1/2 heads): the EAGLE3 drafter's rows and KV, with the head of
models/llama_eagle.py.

What differs from EAGLE-3 is what a row reads: the target's hidden state after its final
norm (the tensor its lm_head reads), not three layers projected; the head drafts over the
target's whole vocabulary with the target's own lm_head. The target hands over its last
layer's output and the drafter applies the target's final norm (the same computation the
target's logits take), so no model needs a second capture point.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
from sglang.srt.speculative.drafters.eagle3 import Eagle3Drafter, FeatureLog, build_head_drafter


class EagleDrafter(Eagle3Drafter):
    """An EAGLE head as the draft model (--speculative-draft-model-path of a head)."""

    name = "eagle"
    algorithm, kind, head_class = "EAGLE", "EAGLE", LlamaForCausalLMEagle

    def bind_target(self, model, config) -> None:
        """The head shares the target's embedding and lm_head and reads its final hidden."""
        inner = getattr(model, "model", None)
        embed, norm = getattr(inner, "embed_tokens", None), getattr(inner, "norm", None)
        lm_head = getattr(model, "lm_head", None)
        if embed is None or norm is None or lm_head is None:
            raise ValueError(f"{self.algorithm}: the target {type(model).__name__} has no "
                             "model.embed_tokens, model.norm and lm_head for the head to share")
        width = self._input_width()
        if width != 2 * config.hidden_size:
            raise ValueError(f"{self.algorithm}: the head reads {width} numbers a row, the "
                             f"target gives 2 x {config.hidden_size}: the head was trained for "
                             "another target")
        if self.token_map is not None:
            lm_head = _hot_head(lm_head, self.token_map, config.vocab_size)
        self.head.set_embed_and_head(embed, lm_head)
        self.target_norm = norm
        self.layers = [config.num_hidden_layers - 1]

    token_map: Optional[str] = None  # --speculative-token-map, applied to the target's head

    def _use_token_map(self, path: str) -> None:
        self.token_map = path  # the head's lm_head is the target's: limited at bind_target

    def _input_width(self) -> int:
        return self.head.model.fc.weight.shape[1]  # [embedding, hidden]

    @property
    def num_params(self) -> int:
        """The head's layers and the target's lm_head it runs (the embedding is a lookup)."""
        head = self.head.lm_head
        return (sum(p.numel() for p in self.head.parameters())
                + (head.weight.numel() if head is not None else 0))

    def target_layers(self) -> Optional[List[int]]:
        return self.layers

    @torch.inference_mode()
    def on_target_hidden(self, req, start: int, hidden: torch.Tensor) -> None:
        """The target computed tokens [start, start + len(hidden)): keep its final hidden
        state (its last layer's output after its final norm)."""
        if len(hidden):
            log = self.features.setdefault(req.rid, FeatureLog())
            log.add(start, self.target_norm(hidden).to(self.runner.dtype))

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the target's vocabulary


def _hot_head(lm_head, path: str, vocab_size: int):
    """The target's lm_head over the token map's ids only (upstream's FR-Spec for EAGLE): a
    copy of those rows, gathered whole first under TP, so a draft step runs no collective."""
    import logging

    from sglang.srt.distributed.parallel_state import all_gather_last_dim
    from sglang.srt.speculative.token_map import HotVocabHead, load_token_map

    weight = lm_head.weight.detach()
    if getattr(lm_head, "tp_size", 1) > 1:  # vocab-parallel: each rank holds a block of rows
        weight = all_gather_last_dim(weight.t().contiguous()).t()
    weight = weight[:vocab_size]
    ids = load_token_map(path, vocab_size)
    logging.getLogger(__name__).info("Draft token map: %d of %d tokens (%s)", ids.numel(),
                                     vocab_size, path)
    return HotVocabHead(weight, ids)


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> EagleDrafter:
    """EAGLE: a head (--speculative-draft-model-path) reading the target's final hidden; a
    DeepSeek-V3 checkpoint there drafts with its MTP layer, as upstream's EAGLE does."""
    from sglang.srt.speculative.drafters import nextn

    if nextn.is_mtp_checkpoint(cfg.draft_model_path):
        return nextn.build(cfg, server_args, max_running, context_len, max_total_tokens,
                           chunk_size)
    return build_head_drafter(EagleDrafter, cfg, server_args, max_running, context_len,
                              max_total_tokens, chunk_size)
