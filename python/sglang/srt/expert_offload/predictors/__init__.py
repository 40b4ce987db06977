"""Expert predictors by name (sglang.srt.registry.EXPERT_PREDICTORS)."""

from __future__ import annotations

from typing import Dict

import torch

from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.expert_offload.predictors.draft import DraftPredictor
from sglang.srt.expert_offload.predictors.ensemble import EnsemblePredictor
from sglang.srt.expert_offload.predictors.layer_ahead import LayerAheadPredictor
from sglang.srt.expert_offload.predictors.reuse import ReusePredictor
from sglang.srt.expert_offload.routing.router_stack import RouterView
from sglang.srt.registry import EXPERT_PREDICTORS

PREDICTORS = EXPERT_PREDICTORS.names

__all__ = ["PREDICTORS", "DraftPredictor", "EnsemblePredictor", "ExpertPredictor",
           "LayerAheadPredictor", "ReusePredictor", "build_predictor"]


def build_predictor(name: str, views: Dict[int, RouterView], embed: torch.nn.Embedding,
                    width: int, num_slots: int, keep_width: int,
                    min_prob: float) -> ExpertPredictor:
    return EXPERT_PREDICTORS.load(name)(views, embed, width, num_slots, keep_width, min_prob)
