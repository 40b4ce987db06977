"""The drafter contracts: the null draft KV of n-grams, the draft model as its own draft KV,
what an observer hears while a tree is drafted, and budget policies."""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang.srt.speculative.budget_policy import FixedBudget
from sglang.srt.speculative.drafters.base import NO_DRAFT_KV, DraftObserver
from sglang.test.scheduler_driver import greedy, make_scheduler, run

PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5, 9], [2, 7, 7, 3, 11, 4]]


class Listener(DraftObserver):
    def __init__(self, hidden: bool) -> None:
        self.hidden = hidden
        self.levels: List[List[int]] = []  # per call: nodes of each request's tree so far
        self.rows: List[int] = []
        self.layers: set = set()

    def on_level(self, reqs, trees) -> None:
        assert len(reqs) == len(trees)
        self.levels.append([len(t) for t in trees])

    def wants_hidden(self) -> bool:
        return self.hidden

    def on_hidden(self, rids, tokens, hidden: Dict[int, torch.Tensor]) -> None:
        assert len(rids) == len(tokens)
        assert all(h.shape[0] == len(tokens) for h in hidden.values())
        self.rows.append(len(tokens))
        self.layers.update(hidden)


def test_ngram_has_the_null_draft_kv(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM")
    spec = sched.spec
    assert spec.draft_kv is NO_DRAFT_KV and not spec.draft_kv.enabled
    assert spec.draft_allocator is None
    got = run(sched, PROMPTS, [greedy(12)] * 2)
    assert all("draft_cached_tokens" not in upd.extra_meta for _, upd in got.values())
    sched.check_all_free()


def test_an_observer_hears_each_level_and_the_residuals_it_asks_for(tiny_llama_dir):
    plain = run(make_scheduler(tiny_llama_dir), PROMPTS, [greedy(12)] * 2)
    for hidden in (False, True):
        sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                               speculative_draft_model_path=tiny_llama_dir,
                               speculative_num_steps=3)
        assert sched.spec.draft_kv is sched.spec.drafter  # a draft model owns its KV
        listener = Listener(hidden)
        sched.spec.drafter.observe(listener)
        got = run(sched, PROMPTS, [greedy(12)] * 2)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
        # a chain of 3: told after levels 1 and 2 (root + 1, root + 2 nodes), not after 3
        assert listener.levels and {n for lv in listener.levels for n in lv} <= {2, 3}
        if hidden:
            n_layers = sched.spec.draft_kv.model_config.num_hidden_layers
            assert listener.rows and listener.layers == set(range(n_layers))
        else:
            assert not listener.rows  # residuals are captured only when asked for
        sched.check_all_free()


def test_a_fixed_budget_runs_for_every_eligible_request_until_reset(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM",
                           speculative_num_draft_tokens=6, speculative_disable_cost_model=False)
    spec = sched.spec
    assert not spec.policy.forced
    spec.use_policy(FixedBudget(3))
    budgets = []
    propose = spec.propose

    def traced(reqs):
        proposal = propose(reqs)
        assert len(proposal.trees) == len(reqs)  # one entry per request asked, in order
        assert all(t is None or len(t) <= 3 for t in proposal.trees)
        if any(spec.eligible(r) for r in reqs):  # nobody eligible (a prompt step): budget 1
            budgets.append(proposal.budget)
        return proposal

    spec.propose = traced
    run(sched, PROMPTS, [greedy(10)] * 2)
    assert budgets and set(budgets) == {3}
    spec.use_policy(None)
    assert spec.policy is spec.default_policy and not spec.policy.forced
    sched.check_all_free()
