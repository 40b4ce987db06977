"""The predictor interface: each hook returns {layer: experts, most wanted first}."""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from sglang.srt.expert_offload.messages import StepContext


class ExpertPredictor:
    """Base: predicts nothing. Each hook returns {layer: experts, most wanted first}."""

    name = "none"

    def begin_step(self, ctx: StepContext) -> Dict[int, List[int]]:
        return {}

    def before_verify(self, ctx: StepContext) -> Dict[int, List[int]]:
        return {}

    def on_draft_level(self, ctx: StepContext) -> Dict[int, List[int]]:
        return {}

    def use_draft_hidden(self, hidden_size: int, num_layers: int) -> bool:
        """Can this predictor route the draft's own residual streams (a draft of
        `hidden_size` with `num_layers` layers)? If so, on_draft_hidden will be called."""
        return False

    def on_draft_hidden(self, rids: List[str], tokens: List[int],
                        hidden: Dict[int, torch.Tensor]) -> Dict[int, List[int]]:
        return {}

    def wants_catch_up(self) -> bool:
        """Does this predictor learn from the draft's catch-up residuals (on_draft_catch_up:
        rows (rid, token index) the draft read)?"""
        return False

    def on_draft_catch_up(self, rids: List[str], indices: List[int],
                          hidden: Dict[int, torch.Tensor]) -> bool:
        """Returns whether it wants more."""
        return False

    def on_moe_input(self, layer: int, normed: torch.Tensor, residual: torch.Tensor,
                     ctx: Optional[StepContext]) -> Dict[int, List[int]]:
        return {}

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        pass

    def keep_for(self, layer: int) -> Set[int]:
        """Experts of `layer` this step's pass may well use beyond those asked for: a
        prefetch must not evict them (a swap of two likely experts costs a load and saves
        none, and loads are what the slow tier is short of)."""
        return set()

    def scores_for(self, layer: int) -> Dict[int, float]:
        """How likely this step's pass is to use each expert of `layer` (router mass summed
        over the pass's rows), where the predictor knows: a prefetch may then evict a kept
        expert for a likelier one (ExpertStore.prefetch_experts). Empty: keep_for rules."""
        return {}

    def row_experts(self, ctx: StepContext) -> Optional[tuple]:
        """(layers, [L, rows, E] bool): per row of the pass, the experts it is predicted to
        be routed to, for predictors that route rows (None: this one does not)."""
        return None

    def figures(self) -> dict:
        """The predictor's own state for /server_info (the calibrated rates)."""
        return {}

    def forget(self, rid: str) -> None:
        pass


def build(views, embed, width: int, num_slots: int, keep_width: int,
          min_prob: float) -> ExpertPredictor:
    return ExpertPredictor()
