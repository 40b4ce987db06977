"""Expert predictors by name (`--moe-prefetch-predictor`)."""

from __future__ import annotations

from typing import Dict

import torch

from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.expert_offload.predictors.draft import DraftPredictor
from sglang.srt.expert_offload.predictors.ensemble import EnsemblePredictor
from sglang.srt.expert_offload.predictors.layer_ahead import LayerAheadPredictor
from sglang.srt.expert_offload.predictors.reuse import ReusePredictor
from sglang.srt.expert_offload.routing.router_stack import RouterView

PREDICTORS = ("none", "reuse", "layer_ahead", "draft", "ensemble")


def build_predictor(name: str, views: Dict[int, RouterView], embed: torch.nn.Embedding,
                    width: int, num_slots: int, keep_width: int,
                    min_prob: float) -> ExpertPredictor:
    if name not in PREDICTORS:
        raise ValueError(f"--moe-prefetch-predictor must be one of {PREDICTORS}, got {name!r}")
    if name == "reuse":
        return ReusePredictor(width)
    if name == "layer_ahead":
        return LayerAheadPredictor(views, width)
    if name == "draft":
        return DraftPredictor(views, embed, width, keep_width, min_prob)
    if name == "ensemble":
        return EnsemblePredictor([DraftPredictor(views, embed, width, keep_width, min_prob),
                                  LayerAheadPredictor(views, width),
                                  ReusePredictor(width)], num_slots)
    return ExpertPredictor()
