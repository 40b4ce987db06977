"""`ensemble`: the draft, layer-ahead and reuse predictors merged under one budget."""

from __future__ import annotations

from typing import Dict, List, Sequence

from sglang.srt.expert_offload.predictors.base import ExpertPredictor


class EnsemblePredictor(ExpertPredictor):
    """Union of the others, interleaved by rank, cut at `budget` experts per layer (what the
    layer's fast tier can hold: a byte budget of budget x expert bytes)."""

    name = "ensemble"

    def __init__(self, members: Sequence[ExpertPredictor], budget: int) -> None:
        self.members, self.budget = list(members), budget

    def _merge(self, answers: List[Dict[int, List[int]]]) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for layer in sorted({k for a in answers for k in a}):
            lists = [a.get(layer, []) for a in answers]
            merged: List[int] = []
            for rank in range(max(len(x) for x in lists)):
                for x in lists:
                    if rank < len(x) and x[rank] not in merged:
                        merged.append(x[rank])
            out[layer] = merged[: self.budget]
        return out

    def begin_step(self, ctx):
        return self._merge([m.begin_step(ctx) for m in self.members])

    def before_verify(self, ctx):
        return self._merge([m.before_verify(ctx) for m in self.members])

    def on_draft_level(self, ctx):
        return self._merge([m.on_draft_level(ctx) for m in self.members])

    def use_draft_hidden(self, hidden_size, num_layers):
        return any([m.use_draft_hidden(hidden_size, num_layers) for m in self.members])

    def on_draft_hidden(self, rids, tokens, hidden):
        return self._merge([m.on_draft_hidden(rids, tokens, hidden) for m in self.members])

    def wants_catch_up(self):
        return any(m.wants_catch_up() for m in self.members)

    def on_draft_catch_up(self, rids, indices, hidden):
        return any([m.on_draft_catch_up(rids, indices, hidden) for m in self.members])

    def on_moe_input(self, layer, normed, residual, ctx):
        return self._merge([m.on_moe_input(layer, normed, residual, ctx) for m in self.members])

    def on_routed(self, layer, topk_ids):
        for m in self.members:
            m.on_routed(layer, topk_ids)

    def keep_for(self, layer):
        return set().union(*(m.keep_for(layer) for m in self.members))

    def scores_for(self, layer):
        out: Dict[int, float] = {}
        for m in self.members:
            for e, v in m.scores_for(layer).items():
                out[e] = max(v, out.get(e, v))
        return out

    def row_experts(self, ctx):
        return next((r for m in self.members if (r := m.row_experts(ctx)) is not None), None)

    def figures(self):
        out = {}
        for m in self.members:
            out.update(m.figures())
        return out

    def forget(self, rid):
        for m in self.members:
            m.forget(rid)


def build(views, embed, width: int, num_slots: int, keep_width: int,
          min_prob: float) -> EnsemblePredictor:
    from sglang.srt.expert_offload.predictors.draft import DraftPredictor
    from sglang.srt.expert_offload.predictors.layer_ahead import LayerAheadPredictor
    from sglang.srt.expert_offload.predictors.reuse import ReusePredictor

    return EnsemblePredictor([DraftPredictor(views, embed, width, keep_width, min_prob),
                              LayerAheadPredictor(views, width),
                              ReusePredictor(width)], num_slots)
