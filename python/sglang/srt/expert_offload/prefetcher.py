"""Draft-guided expert prefetch: predict the experts the next forward will route to and load
them through the ExpertStore before the layer asks for them.

One step of the scheduler, and when each predictor speaks:

    begin_step(ctx: the requests' last tokens)  -> `reuse` issues its loads; they run on the
                                                   store's loader thread while the draft proposes
    drafter proposes trees, level by level:
      on_draft_level(ctx: root + nodes so far)  -> `draft` routes the tokens drafted so far and
                                                   issues their loads, which run while the draft
                                                   computes its next levels
    before_verify(ctx: the tokens of the pass)  -> `draft` issues what is still missing (layer
                                                   order, so later layers load while early ones
                                                   compute)
    verify forward, for each MoE layer L:
        on_moe_input(L, normed, residual)        -> `layer_ahead` routes L's state through the
                                                   next MoE layer's router and issues its loads
        on_routed(L, topk_ids)                   -> figures: was what L needs resident in time?

Predictors only choose experts; the store decides slots and never evicts a pinned (running)
or loading expert, so a wrong or late prediction costs time, never correctness: the forward's
numerics do not depend on residency (see experts.py).

Figures (per layer, `PrefetchStats`): recall = needed experts resident when the layer ran /
needed; precision = prefetched experts the layer then used / prefetched; over-fetch =
prefetched / prefetched-and-used; bytes fetched vs used. The store adds hits, loads and
stall time (`ExpertStore.stats`). Recall mixes two limits, so two more figures split it:
the predictor's own (`predicted_recall`: needed experts it named, loaded in time or not;
`predicted_overfetch`: named / named-and-used) and the fast tier's (`recall_ceiling`: at
most `num_slots` of a pass's experts can be resident when its layer starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.expert_offload.stats import PrefetchStats
from sglang.srt.utils import host_sync

if TYPE_CHECKING:
    from sglang.srt.expert_offload.gate import PrefetchGate
    from sglang.srt.expert_offload.store import ExpertStore


class ExpertPrefetcher:
    """Glue between the scheduler, the MoE layers, one predictor and the store."""

    def __init__(self, store: "ExpertStore", predictor: ExpertPredictor, expert_bytes: int,
                 gate: Optional["PrefetchGate"] = None) -> None:
        self.store, self.predictor = store, predictor
        self.stats = PrefetchStats(expert_bytes, store.num_slots)
        self.ctx: Optional[StepContext] = None
        # The online A/B against on-demand loads (gate.py; None: always on). `active` is
        # its choice for the step under way: off, no predictor hook runs and nothing loads
        # early, only the predictors' own bookkeeping of what was routed.
        self.gate = gate
        self.active = True
        # layer -> every expert predicted for its next use (all hooks of this step): a later
        # prediction must not evict an earlier one, or the layer pays a reload
        self._wanted: Dict[int, set] = {}

    def _issue(self, wanted: Dict[int, List[int]]) -> None:
        for layer in sorted(wanted):
            # every EP rank predicts alike (the same draft, the same states); each loads the
            # experts it holds, up to its own slots
            ranked = [e for e in wanted[layer] if self.store.owns(e)]
            if ranked:
                self.stats.predicted(layer, ranked)
                # every predicted expert is protected, not only the ones that fit: evicting
                # a likely one to load another costs a load and saves none (docs/decisions.md)
                protect = self._wanted.setdefault(layer, set())
                protect.update(ranked)
                protect.update(self.predictor.keep_for(layer))
                fetched = self.store.prefetch_experts(layer, ranked[: self.store.num_slots],
                                                      protect, self.predictor.scores_for(layer))
                self.stats.fetched(layer, fetched)

    # scheduler hooks
    def begin_step(self, ctx: StepContext, decode_only: bool = False) -> bool:
        """A step starts; `decode_only`: every request decodes (no prompt chunk), a step
        the gate may run without prefetch. Returns whether this step prefetches."""
        self.ctx = ctx
        self.active = self.gate.choose(len(ctx.rids)) if (
            self.gate is not None and decode_only) else True
        if self.active:
            self._issue(self.predictor.begin_step(ctx))
        return self.active

    def end_step(self, batch_size: int, budget: int, seconds: float) -> None:
        """A pure decode step (begun with decode_only) took `seconds`: the gate's sample."""
        if self.gate is not None:
            self.gate.observe(batch_size, budget, self.active, seconds)

    def before_verify(self, ctx: StepContext) -> None:
        self.ctx = ctx
        if self.active:
            self._issue(self.predictor.before_verify(ctx))

    def on_draft_level(self, ctx: StepContext) -> None:
        """Called by the drafter after each tree level (spec_worker wires it)."""
        if self.active:
            self._issue(self.predictor.on_draft_level(ctx))

    def use_draft_hidden(self, hidden_size: int, num_layers: int) -> bool:
        return self.predictor.use_draft_hidden(hidden_size, num_layers)

    def on_draft_hidden(self, rids: List[str], tokens: List[int],
                        hidden: Dict[int, torch.Tensor]) -> None:
        """Called by the drafter after each of its forwards (the scheduler wires it)."""
        if self.active:
            self._issue(self.predictor.on_draft_hidden(rids, tokens, hidden))

    def forget(self, rid: str) -> None:
        self.predictor.forget(rid)

    # model hooks
    def on_moe_input(self, layer: int, normed: torch.Tensor, residual: torch.Tensor) -> None:
        if self.active:
            self._issue(self.predictor.on_moe_input(layer, normed, residual, self.ctx))

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            routed = host_sync.present_ids(topk_ids, self.store.num_experts(layer),
                                           "prefetch_routed")
            needed = [e for e in routed if self.store.owns(e)]
            self.stats.used(layer, needed, self.store.resident(layer))
        else:
            self.stats.skip(layer)
        self._wanted.pop(layer, None)
        self.predictor.on_routed(layer, topk_ids)

    def figures(self) -> dict:
        store = self.store.stats().to_dict()
        out = {"predictor": self.predictor.name, **self.stats.to_dict(),
               **self.predictor.figures(),
               "hit_rate": store["total"]["hit_rate"],
               "stall_seconds": store["total"]["stall_seconds"],
               "bytes_loaded": store["total"]["bytes_loaded"]}
        if self.gate is not None:
            out["gate"] = self.gate.to_dict()
        return out
