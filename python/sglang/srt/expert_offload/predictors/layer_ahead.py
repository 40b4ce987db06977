"""`layer_ahead`: route layer L's residual through the next MoE layer's router."""

from __future__ import annotations

import bisect
from typing import Dict, List

from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.expert_offload.routing.router_stack import RouterView, route_rank


class LayerAheadPredictor(ExpertPredictor):
    """While layer L runs, route L's residual stream through the next MoE layer's router:
    the residual changes little from one layer to the next."""

    name = "layer_ahead"

    def __init__(self, views: Dict[int, RouterView], width: int) -> None:
        self.views, self.layers, self.width = views, sorted(views), width

    def on_moe_input(self, layer, normed, residual, ctx) -> Dict[int, List[int]]:
        i = bisect.bisect_right(self.layers, layer)  # the next MoE layer (dense ones skipped)
        if i == len(self.layers):
            return {}
        view = self.views[self.layers[i]]
        return {view.layer: route_rank(view, residual, self.width)}


def build(views, embed, width: int, num_slots: int, keep_width: int,
          min_prob: float) -> LayerAheadPredictor:
    return LayerAheadPredictor(views, width)
