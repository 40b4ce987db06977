"""`reuse`: the experts the last forward routed to (temporal locality)."""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.utils import host_sync


class ReusePredictor(ExpertPredictor):
    """Temporal locality: the experts the last forward routed to, per layer (most used first),
    plus the `width` most frequent others of a decayed history."""

    name = "reuse"

    def __init__(self, width: int, decay: float = 0.8) -> None:
        self.width, self.decay = width, decay
        self.last: Dict[int, List[int]] = {}
        self.history: Dict[int, torch.Tensor] = {}

    def begin_step(self, ctx: StepContext) -> Dict[int, List[int]]:
        out = {}
        for layer, ranked in self.last.items():
            hist = self.history[layer]
            extra = [int(e) for e in torch.argsort(hist, descending=True, stable=True).tolist()
                     if e not in ranked and hist[e] > 0][: self.width]
            out[layer] = ranked + extra
        return out

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        ids = host_sync.to_cpu(topk_ids.reshape(-1), "prefetch_reuse")
        num = int(ids.max()) + 1 if ids.numel() else 0
        hist = self.history.get(layer)
        if hist is None or hist.numel() < num:
            grown = torch.zeros(max(num, 1))
            if hist is not None:
                grown[: hist.numel()] = hist
            hist = grown
        counts = torch.bincount(ids, minlength=hist.numel()).float()
        self.history[layer] = hist * self.decay + counts
        order = torch.argsort(counts, descending=True, stable=True)
        self.last[layer] = [int(e) for e in order[: int((counts > 0).sum())].tolist()]


def build(views, embed, width: int, num_slots: int, keep_width: int,
          min_prob: float) -> ReusePredictor:
    return ReusePredictor(width)
