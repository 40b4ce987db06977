"""The fast tier's slots of one MoE layer (store.py moves experts in and out of them) and
which slot a load takes: a demand load's least recently used victim, a scored prefetch's
least worth one.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from sglang.srt.expert_offload.store_stats import LayerStats

FREE, LOADING, RESIDENT = "free", "loading", "resident"
# A scored prefetch evicts a kept expert only for one at least this many times likelier:
# kept must not mean frozen, but swaps between near-equals cost loads and save no stalls
# (docs/decisions.md).
SWAP_MARGIN = 2.0


@dataclasses.dataclass
class Slot:
    expert: int = -1
    state: str = FREE
    pins: int = 0
    started: bool = False  # LOADING: a thread has begun the copy (else it waits in the queue)
    last_use: int = 0
    event: Optional[object] = None  # CUDA event of the load (GPU)
    # CUDA event recorded at the last release: the kernels that read the slot were queued
    # before it, and a load into the slot must not overwrite them before they run (GPU)
    freed: Optional[object] = None


class Layer:
    """One MoE layer's fast tier: its slot tensors, each slot's state, expert -> slot."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, num_experts: int) -> None:
        self.w13, self.w2 = w13, w2  # [S, 2I, H], [S, H, I]: the fast tier
        self.num_experts = num_experts
        self.slots = [Slot() for _ in range(w13.shape[0])]
        self.where: Dict[int, int] = {}  # expert -> slot (LOADING or RESIDENT)
        self.stats = LayerStats()


def victim(lay: Layer) -> Optional[int]:
    """A demand load's slot: a FREE one, else the least recently used unpinned one."""
    best, best_use = None, None
    for j, s in enumerate(lay.slots):
        if s.state == FREE:
            return j
        if s.state == RESIDENT and s.pins == 0 and (best_use is None or s.last_use < best_use):
            best, best_use = j, s.last_use
    return best


def victim_scored(lay: Layer, wanted: set, keep: set, scores: Dict[int, float],
                  score: float) -> Optional[int]:
    """A FREE slot, else the unpinned RESIDENT slot of least worth (unscored and
    unprotected: nothing; unscored and protected: infinite; else its score; ties: least
    recently used) if `score` is SWAP_MARGIN times its worth; never one of `wanted`.
    Without scores: the least recently used slot outside `keep`."""
    best, best_key = None, None
    for j, s in enumerate(lay.slots):
        if s.state == FREE:
            return j
        if s.state != RESIDENT or s.pins or s.expert in wanted:
            continue
        worth = scores.get(s.expert, float("inf") if s.expert in keep else float("-inf"))
        key = (worth, s.last_use)
        if worth * SWAP_MARGIN < score and (best_key is None or key < best_key):
            best, best_key = j, key
    return best
