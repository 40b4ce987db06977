"""Expert offload in the scheduler step: prefetch around the draft and the forward, the
prefetch gate's timing, and budget-aware draft trees."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.managers.step_hooks import StepHook
from sglang.srt.managers.step_plan import StepPlan
from sglang.srt.utils import host_sync

if TYPE_CHECKING:
    from sglang.srt.expert_offload.prefetcher import ExpertPrefetcher
    from sglang.srt.expert_offload.tree_budget import TreeBudget
    from sglang.srt.speculative.spec_worker import SpecWorker


def step_context(plan: StepPlan) -> StepContext:
    """The requests of the forward and the tokens each feeds it (a tree's nodes included)."""
    return StepContext([it.req.rid for it in plan.items], [it.tokens() for it in plan.items],
                       [it.tree is not None for it in plan.items],
                       [it.req.kv_len for it in plan.items])


class PrefetchHook(StepHook):
    """Loads start for the last tokens before the draft runs, and for the pass's own tokens
    before the forward; a pure decode step's time is the gate's sample."""

    def __init__(self, prefetcher: "ExpertPrefetcher") -> None:
        self.prefetcher = prefetcher

    def before_draft(self, plan: StepPlan) -> None:
        if plan.items:
            self.prefetcher.begin_step(step_context(plan), plan.decode_only)

    def before_forward(self, plan: StepPlan) -> None:
        self.prefetcher.before_verify(step_context(plan))

    def after_step(self, plan: StepPlan, seconds: float) -> None:
        if plan.decode_only and plan.typical:  # the draft and predictors' work included
            self.prefetcher.end_step(len(plan.items), plan.budget, seconds)

    def on_finished(self, req) -> None:
        self.prefetcher.forget(req.rid)


class TreeBudgetHook(StepHook):
    """Budget-aware trees (expert_offload/tree_budget.py): price each tree's branches by the
    expert loads only they need, against the tokens they are expected to bring."""

    def __init__(self, budget: "TreeBudget", prefetcher: "ExpertPrefetcher",
                 spec: "SpecWorker") -> None:
        self.budget, self.prefetcher, self.spec = budget, prefetcher, spec

    def before_allocate(self, plan: StepPlan) -> None:
        # not with a prompt chunk: its rows route to most experts, which load anyway
        if not plan.has_trees or not self.prefetcher.active or plan.has_prefill:
            return
        got = self.prefetcher.predictor.row_experts(step_context(plan))
        if got is None:
            return
        layers, chosen = got
        # [L, rows, E]: the pricing is host-side bookkeeping
        chosen = host_sync.to_cpu(chosen, "prefetch_pricing")
        fixed = torch.zeros(chosen.shape[0], chosen.shape[2], dtype=torch.bool)
        for i, layer in enumerate(layers):  # resident or loading: no load to price
            fixed[i, self.prefetcher.store.mapped(layer)] = True
        trees, rates, rows, offset = [], [], [], 0
        for it in plan.items:
            r = chosen[:, offset : offset + it.num_tokens].transpose(0, 1)  # [n, L, E]
            offset += it.num_tokens
            trees.append(it.tree)
            rows.append(r if it.tree is not None else None)
            rates.append(self.spec.controller(it.req).decision_rate() if it.tree is not None else 0.0)
            if it.tree is None:  # rows that run anyway: their experts load regardless
                fixed |= r.any(0)
        for it, new in zip(plan.items, self.budget.prune(trees, rates, rows, fixed)):
            if it.tree is not None and new is not it.tree:
                it.tree = new if len(new) > 1 else None  # nothing left: a plain step

    def after_step(self, plan: StepPlan, seconds: float) -> None:
        if plan.decode_only and plan.typical and plan.has_trees:
            self.budget.observe_step(len(plan.items), seconds)
        if plan.items:
            total = self.prefetcher.store.stats().total()
            # waits for late prefetches count: most loads a layer waits for were queued early
            self.budget.observe_store(total.stall_seconds, total.misses + total.late,
                                      sample=plan.decode_only, loads=total.loads,
                                      load_seconds=total.load_seconds)
