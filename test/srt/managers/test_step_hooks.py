"""The scheduler step's hook points: every hook is called at each point, in order, with one
record per scheduled request; a hook that cuts trees before allocation changes no output."""

from __future__ import annotations

from typing import List

from sglang.srt.managers.step_hooks import StepHook
from sglang.srt.managers.step_plan import StepPlan
from sglang.test.scheduler_driver import greedy, make_scheduler, run

PHASES = ["before_draft", "draft", "before_allocate", "before_forward", "after_forward",
          "after_step"]


class Recorder(StepHook):
    def __init__(self) -> None:
        self.calls: List[str] = []
        self.rows: List[List[int]] = []  # per forward: the rows each request fed it
        self.trees_seen = 0
        self.finished: List[str] = []
        self.seconds: List[float] = []

    def before_draft(self, plan: StepPlan) -> None:
        self.calls.append("before_draft")
        assert all(it.tree is None for it in plan.items)  # nothing drafted yet

    def draft(self, plan: StepPlan) -> None:
        self.calls.append("draft")

    def before_allocate(self, plan: StepPlan) -> None:
        self.calls.append("before_allocate")

    def before_forward(self, plan: StepPlan) -> None:
        self.calls.append("before_forward")
        for it in plan.items:
            assert len(it.tokens()) == it.num_tokens
            if it.tree is not None:
                self.trees_seen += 1
                assert it.tokens()[0] == it.req.fill_ids[-1]  # the root is the last token
        self.rows.append([it.num_tokens for it in plan.items])

    def after_forward(self, plan: StepPlan) -> None:
        self.calls.append("after_forward")

    def after_step(self, plan: StepPlan, seconds: float) -> None:
        self.calls.append("after_step")
        self.seconds.append(seconds)

    def on_finished(self, req) -> None:
        self.finished.append(req.rid)


class CutTrees(StepHook):
    """Drops every draft tree after the draft ran: those requests decode plainly."""

    def before_allocate(self, plan: StepPlan) -> None:
        for it in plan.items:
            it.tree = None


PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [2, 7, 7, 3, 11, 4, 7, 3, 11]]


def test_hooks_run_in_step_order_with_one_record_per_request(tiny_llama_dir):
    plain = run(make_scheduler(tiny_llama_dir), PROMPTS, [greedy(16)] * 2)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_dir, speculative_num_steps=3)
    rec = Recorder()
    sched.hooks.hooks.append(rec)
    got = run(sched, PROMPTS, [greedy(16)] * 2)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    steps = len(rec.seconds)
    assert steps > 0 and rec.calls == PHASES * steps
    assert rec.trees_seen > 0  # the speculation hook attached trees before the forward
    assert sorted(rec.finished) == ["0", "1"]  # told once per request, when it left
    assert all(s >= 0 for s in rec.seconds)
    sched.check_all_free()


def test_a_hook_cutting_trees_before_allocation_changes_no_output(tiny_llama_dir):
    plain = run(make_scheduler(tiny_llama_dir), PROMPTS, [greedy(16)] * 2)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_dir, speculative_num_steps=3)
    sched.hooks.hooks.append(CutTrees())
    rec = Recorder()
    sched.hooks.hooks.append(rec)
    got = run(sched, PROMPTS, [greedy(16)] * 2)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    assert rec.trees_seen == 0  # no tree reached the forward
    for rid, (_, upd) in got.items():  # every decode step was recorded as a plain one
        assert upd.extra_meta["spec_accept_token_num"] == 0
    assert sched.spec.avg_accept_length() == 1.0
    sched.check_all_free()
