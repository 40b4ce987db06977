"""Step hooks: how speculation and expert offload plug into the scheduler step.

The scheduler calls every hook at each point of the step, in the order they were handed
over; a hook overrides the points it cares about (the base does nothing):

    before_draft    the plan is made; nothing drafted or allocated yet
    draft           speculation attaches draft trees to decoding requests
    before_allocate trees are final but may still be cut (budget-aware trees)
    before_forward  KV is allocated; the batch is about to run
    after_forward   outputs are appended (and trees verified)
    after_step      the step's wall time is known
    on_finished     a request left for good (finished or aborted)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Sequence

from sglang.srt.managers.step_plan import StepPlan

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.speculative.spec_worker import SpecWorker


class StepHook:
    def before_draft(self, plan: StepPlan) -> None: ...

    def draft(self, plan: StepPlan) -> None: ...

    def before_allocate(self, plan: StepPlan) -> None: ...

    def before_forward(self, plan: StepPlan) -> None: ...

    def after_forward(self, plan: StepPlan) -> None: ...

    def after_step(self, plan: StepPlan, seconds: float) -> None: ...

    def on_finished(self, req: "Req") -> None: ...


class StepHooks(StepHook):
    """Every hook, called in order."""

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        self.hooks: List[StepHook] = list(hooks)

    def before_draft(self, plan: StepPlan) -> None:
        for h in self.hooks:
            h.before_draft(plan)

    def draft(self, plan: StepPlan) -> None:
        for h in self.hooks:
            h.draft(plan)

    def before_allocate(self, plan: StepPlan) -> None:
        for h in self.hooks:
            h.before_allocate(plan)

    def before_forward(self, plan: StepPlan) -> None:
        for h in self.hooks:
            h.before_forward(plan)

    def after_forward(self, plan: StepPlan) -> None:
        for h in self.hooks:
            h.after_forward(plan)

    def after_step(self, plan: StepPlan, seconds: float) -> None:
        for h in self.hooks:
            h.after_step(plan, seconds)

    def on_finished(self, req: "Req") -> None:
        for h in self.hooks:
            h.on_finished(req)


class SpeculationHook(StepHook):
    """Draft trees for decoding requests; after the forward, feed the fallback controllers,
    the draft's catch-up on new prompts and the cost model."""

    def __init__(self, spec: "SpecWorker", running: Callable[[], List["Req"]]) -> None:
        self.spec, self.running = spec, running

    def draft(self, plan: StepPlan) -> None:
        decoding = [it for it in plan.items if it.count == 1]
        proposal = self.spec.propose([it.req for it in decoding])
        for it, tree in zip(decoding, proposal.trees):
            it.tree = tree
        plan.budget, plan.typical = proposal.budget, proposal.typical
        plan.capture_layers = self.spec.capture_layers

    def after_forward(self, plan: StepPlan) -> None:
        spec = self.spec
        if plan.captured is not None:  # before any catch-up below reads them
            spec.take_hidden(plan)
        for it in plan.items:
            if it.tree is not None:
                spec.record(it.req, it.offered, it.accepted, it.emitted)
            elif it.count == 1:  # a plain decode step
                spec.record(it.req, offered=0, accepted=0, emitted=1)
        prefill = [it for it in plan.items if it.is_prefill]
        if plan.items:
            spec.after_prefill([it.req for it in prefill if not it.req.finished
                                and it.req.kv_len == it.req.fill_len - 1], self.running(),
                               sum(it.count for it in prefill))
        spec.end_step(len(plan.items), bool(prefill))

    def on_finished(self, req: "Req") -> None:
        self.spec.forget(req)
