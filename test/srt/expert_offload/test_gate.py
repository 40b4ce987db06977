"""The prefetch gate (expert_offload/gate.py): its A/B decisions on scripted step
times, and through the real Scheduler with a tiny MoE: a prefetch that makes steps slower is
turned off, output unchanged and every slot back to baseline."""

from __future__ import annotations

import time

import pytest

from sglang.srt.expert_offload.gate import OFF, ON, PrefetchGate, bucket
from sglang.test.scheduler_driver import greedy, make_scheduler, run


def drive(gate: PrefetchGate, steps: int, seconds, bs: int = 1, budget: int = 1) -> list:
    """Run `steps` gated steps whose time is seconds(arm, step); return the arms chosen."""
    arms = []
    for i in range(steps):
        arm = gate.choose(bs)
        gate.observe(bs, budget, arm, seconds(arm, i))
        arms.append(arm)
    return arms


def test_gate_measures_in_blocks_then_keeps_the_faster_arm() -> None:
    gate = PrefetchGate(window=8, min_samples=3, explore_every=1000)
    arms = drive(gate, 20, lambda arm, i: 0.5 if arm is ON else 0.4)
    # blocks of 4, prefetch first; a block's first step ran on the other arm's residency
    assert arms[:8] == [ON] * 4 + [OFF] * 4
    assert arms[8:] == [OFF] * 12
    d = gate.to_dict()
    assert (d["steps_on"], d["steps_off"]) == (4, 16)
    assert d["keys"]["bs1_budget1"]["on"] == {"best_s": 0.5, "samples": 3, "steps": 4}
    assert d["keys"]["bs1_budget1"]["off"]["best_s"] == pytest.approx(0.4)
    gate = PrefetchGate(window=8, min_samples=3, explore_every=1000)
    # noise only adds time: one slow prefetch step does not turn a faster prefetch off
    arms = drive(gate, 20, lambda arm, i: (0.3 if i != 2 else 2.0) if arm is ON else 0.4)
    assert arms[8:] == [ON] * 12


def test_gate_takes_no_sample_from_a_step_after_the_other_arm() -> None:
    """A step inherits the residency the previous step left: an on-demand step right after
    a prefetching one is fast on the prefetch's loads and must not price on-demand."""
    gate = PrefetchGate(window=8, min_samples=3, explore_every=1000)
    after = {}

    def seconds(arm, i):
        inherited = after.get("prev")
        after["prev"] = arm
        return 0.1 if (arm is OFF and inherited is ON) else (0.5 if arm is OFF else 0.3)

    arms = drive(gate, 20, seconds)
    assert arms[8:] == [ON] * 12  # the 0.1 s transition step did not make on-demand win


def test_gate_remeasures_the_other_arm_from_scratch_and_follows_a_change() -> None:
    gate = PrefetchGate(window=8, min_samples=3, explore_every=10)
    # prefetch loses for 40 steps (a busy disk), then wins
    arms = drive(gate, 60, lambda arm, i: (0.5 if i < 40 else 0.2) if arm is ON else 0.4)
    on = [i for i, arm in enumerate(arms) if arm is ON]
    # measuring (0-7), then a block of 4 fresh prefetch steps each time it sat out 10
    # steps; from the re-measure at 42 it wins, and the off arm gets its own (52-55)
    assert on == [0, 1, 2, 3, 14, 15, 16, 17, 28, 29, 30, 31] + list(range(42, 52)) \
        + list(range(56, 60))
    # a re-measure forgets the old samples: the arm's best is from its fresh steps
    assert gate.to_dict()["keys"]["bs1_budget1"]["on"]["best_s"] == pytest.approx(0.2)


def test_gate_keeps_batch_sizes_and_budgets_apart() -> None:
    assert [bucket(n) for n in (1, 3, 4, 5, 8, 9, 16, 17)] == [1, 3, 4, 8, 8, 16, 16, 32]
    gate = PrefetchGate(window=8, min_samples=2, explore_every=1000)
    drive(gate, 7, lambda arm, i: 0.5 if arm is ON else 0.4, bs=1, budget=4)
    drive(gate, 7, lambda arm, i: 0.3 if arm is ON else 0.4, bs=8, budget=4)
    drive(gate, 7, lambda arm, i: 0.3 if arm is ON else 0.4, bs=1, budget=1)
    keys = gate.to_dict()["keys"]
    assert set(keys) == {"bs1_budget4", "bs8_budget4", "bs1_budget1"}
    assert all(v[arm]["samples"] >= 2 for v in keys.values() for arm in ("on", "off")), keys
    assert gate.choose(1) is ON  # bs 1 last ran plain: its plain samples decide
    gate.observe(1, 4, ON, 0.5)
    assert gate.choose(1) is OFF  # back at budget 4, where prefetch lost
    assert gate.choose(6) is ON  # bucket 8


def _slow_prefetch(sched, seconds: float) -> None:
    """Make every prefetching step dearer by `seconds` (a predictor whose work costs more
    than the stalls it hides): the gate must find it and turn it off."""
    pf = sched.prefetcher
    issue = pf._issue

    def slow_issue(wanted, issue=issue):
        if pf.active and pf.ctx is not None and getattr(pf, "_slow_step", None) is not pf.ctx:
            pf._slow_step = pf.ctx  # once per step
            time.sleep(seconds)
        return issue(wanted)

    pf._issue = slow_issue


def test_scheduler_turns_off_a_prefetch_that_slows_its_steps(tiny_moe_dir) -> None:
    folder = tiny_moe_dir("qwen2_moe")
    prompts = [[5, 9, 13, 17, 21, 25] * 3]
    ref_sched = make_scheduler(folder)
    ref = run(ref_sched, prompts, [greedy(40)])
    ref_sched.check_all_free()
    sched = make_scheduler(folder, moe_expert_cache_slots=2, moe_prefetch_predictor="reuse",
                           moe_prefetch_width=1)
    assert sched.prefetcher.gate is not None  # on by default
    _slow_prefetch(sched, 0.2)
    got = run(sched, prompts, [greedy(40)])
    assert got["0"][0] == ref["0"][0]
    sched.check_all_free()
    gate = sched.moe_state()["moe_prefetch"]["gate"]
    # a block of 4 prefetching steps (3 measured), then on-demand loads for the rest
    assert gate["steps_on"] == 4 and gate["steps_off"] >= 30, gate
    figs = sched.moe_state()["moe_prefetch"]["total"]
    assert figs["uses"] > 0  # the prefetching steps (and the prefill) were scored
    # /metrics carries the split recall and the gate's steps
    from sglang.srt.metrics.collector import TokenizerMetrics

    metrics = TokenizerMetrics("tiny")
    metrics.refresh(sched.moe_state())
    text = metrics.render()[0].decode()
    assert 'sglang:moe_prefetch_gate_steps_on{layer="all",model_name="tiny",predictor="reuse"} 4.0' in text
    assert 'sglang:moe_prefetch_predicted_recall{layer="all"' in text
    assert 'sglang:moe_prefetch_recall_ceiling{layer="0"' in text
    sched.runner.model.expert_store.close()
    # --moe-prefetch-disable-gate: every step prefetches
    sched = make_scheduler(folder, moe_expert_cache_slots=2, moe_prefetch_predictor="reuse",
                           moe_prefetch_width=1, moe_prefetch_disable_gate=True)
    assert sched.prefetcher.gate is None
    assert "gate" not in sched.moe_state()["moe_prefetch"]
    sched.runner.model.expert_store.close()
