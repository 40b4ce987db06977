"""Budget-aware trees (--moe-prefetch-prune-tree): the pricing on scripted trees and expert
sets, and through the real Scheduler: branches go, the output stays that of plain decoding,
every pool returns to baseline."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.srt.expert_offload.tree_budget import TreeBudget, node_probs, prune_trees
from sglang.srt.speculative.tree import DraftTree
from sglang.test.scheduler_driver import greedy, make_scheduler, run

L, E = 2, 8


def chain(n: int) -> DraftTree:
    t = DraftTree.root_only(1)
    for d in range(n):
        t.add(10 + d, d, -0.1 * (d + 1))
    return t


def rows_of(experts_per_node, layers: int = L) -> torch.Tensor:
    """[n, L, E] bool: node i routes to experts_per_node[i] at every layer."""
    out = torch.zeros(len(experts_per_node), layers, E, dtype=torch.bool)
    for i, experts in enumerate(experts_per_node):
        out[i, :, list(experts)] = True
    return out


def fixed_of(experts) -> torch.Tensor:
    out = torch.zeros(L, E, dtype=torch.bool)
    out[:, list(experts)] = True
    return out


def throughput(trees, probs, rows, fixed, load_s, base_s) -> float:
    """The model the pruning optimises: expected tokens over base time + loads of the union."""
    union = fixed.clone()
    need = torch.zeros_like(fixed)
    tokens = 0.0
    for t, p, r in zip(trees, probs, rows):
        if t is None:
            tokens += 1
            continue
        tokens += sum(p)
        need |= r.any(0)
    return tokens / (base_s + int((need & ~union).sum()) * load_s)


def test_node_probs_follow_the_rate_per_level_and_split_siblings_by_the_draft() -> None:
    assert node_probs(chain(3), 0.5) == pytest.approx([1, 0.5, 0.25, 0.125])
    t = DraftTree.root_only(1)
    a = t.add(5, 0, math.log(0.6))
    t.add(6, 0, math.log(0.2))
    t.add(7, a, math.log(0.6) + math.log(0.5))
    p = node_probs(t, 0.8)
    assert p[1] == pytest.approx(0.8 * 0.75) and p[2] == pytest.approx(0.8 * 0.25)
    assert p[3] == pytest.approx(p[1] * 0.8)  # an only child takes its level's whole rate


def test_a_branch_that_brings_only_new_experts_goes_when_acceptance_is_low() -> None:
    tree = chain(3)
    rows = rows_of([{0, 1}, {0, 1}, {2, 3}, {4, 5}])
    fixed = fixed_of({0, 1})  # resident
    # each of nodes 2 and 3 needs 2 experts x 2 layers = 4 loads of 0.05 s
    low = prune_trees([tree], [node_probs(tree, 0.3)], [rows], fixed, 0.05, 1.0)
    assert low.trees[0].tokens == [1, 10] and low.nodes_removed == 2
    assert low.loads_saved == 8
    high = prune_trees([tree], [node_probs(tree, 0.95)], [rows], fixed, 0.05, 1.0)
    assert high.trees[0] is tree and high.nodes_removed == 0
    # the same branch with its experts resident costs nothing: it stays at any rate
    free = prune_trees([tree], [node_probs(tree, 0.3)], [rows], fixed_of(range(6)), 0.05, 1.0)
    assert free.nodes_removed == 0


def test_experts_another_row_needs_are_not_charged_to_the_branch() -> None:
    """Node 3's experts are also node 1's: dropping node 3 saves no load; node 2's are its
    own. Requests share experts too: a plain request's rows are fixed costs."""
    tree = chain(3)
    rows = rows_of([{0}, {6, 7}, {2, 3}, {6, 7}])
    res = prune_trees([tree], [node_probs(tree, 0.3)], [rows], fixed_of({0}), 0.05, 2.0)
    # node 2 carries node 3 with it (its subtree): both go, for node 2's 4 loads; node 1
    # (0.3 tokens) is worth its 4 loads in a 2 s step
    assert res.trees[0].tokens == [1, 10] and res.loads_saved == 4
    other = chain(1)
    res = prune_trees([tree, None], [node_probs(tree, 0.3), None], [rows, None],
                      fixed_of({0, 2, 3}), 0.05, 2.0)
    assert res.nodes_removed == 0  # node 2's experts are loaded for the plain request anyway
    del other


def test_a_subtree_goes_whole_when_only_together_its_loads_pay() -> None:
    """Nodes 2 and 3 share experts nobody else needs: dropping the leaf alone saves nothing,
    dropping node 2's subtree saves them all."""
    tree = chain(3)
    rows = rows_of([{0}, {0}, {4, 5}, {4, 5}])
    res = prune_trees([tree], [node_probs(tree, 0.4)], [rows], fixed_of({0}), 0.05, 1.0)
    assert res.trees[0].tokens == [1, 10] and res.loads_saved == 4


def test_pruning_never_lowers_the_modelled_throughput() -> None:
    """Random trees, expert sets and prices: the pruned batch's modelled tokens per second is
    at least the unpruned one's, and pruned trees stay valid (root kept, ancestors closed)."""
    rng = random.Random(0)
    for trial in range(200):
        trees, probs, rows = [], [], []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.2:
                trees.append(None), probs.append(None), rows.append(None)
                continue
            t = DraftTree.root_only(1)
            for _ in range(rng.randint(1, 7)):
                parent = rng.randrange(len(t))
                t.add(rng.randint(2, 99), parent, t.scores[parent] + math.log(rng.uniform(.1, 1)))
            trees.append(t)
            probs.append(node_probs(t, rng.uniform(0.1, 0.95)))
            rows.append(torch.rand(len(t), L, E) < 0.25)
        fixed = torch.rand(L, E) < 0.3
        load_s, base_s = rng.uniform(0.001, 0.1), rng.uniform(0.05, 1.0)
        full = throughput(trees, probs, rows, fixed, load_s, base_s)
        union = fixed.clone()
        for r in rows:
            if r is not None:
                union |= r.any(0)
        step_s = base_s + int((union & ~fixed).sum()) * load_s
        res = prune_trees(trees, probs, rows, fixed, load_s, step_s)
        kept_probs, kept_rows = [], []
        for t, new, keep, p, r in zip(trees, res.trees, res.kept, probs, rows):
            if t is None:
                kept_probs.append(None), kept_rows.append(None)
                continue
            assert len(keep) == len(new) and keep[0] == 0
            assert new.tokens == [t.tokens[i] for i in keep]
            assert all(t.parents[i] in keep for i in keep[1:])
            kept_probs.append([p[i] for i in keep])
            kept_rows.append(r[keep])
        pruned = throughput(res.trees, kept_probs, kept_rows, fixed, load_s, base_s)
        assert pruned >= full - 1e-9, (trial, pruned, full)


def test_prices_come_from_the_store_and_the_steps() -> None:
    budget = TreeBudget(decay=0.5)
    tree = chain(2)
    rows = [rows_of([{0}, {1}, {2}])]
    assert budget.prune([tree], [0.1], rows, fixed_of({0})) == [tree]  # nothing measured yet
    budget.observe_store(1.0, 10)  # 0.1 s a miss
    budget.observe_store(1.0, 10)  # no new misses: unchanged
    assert budget.load_s == pytest.approx(0.1)
    budget.observe_store(0.5, 5)  # the stats were reset: counts start over
    assert budget.load_s == pytest.approx(0.1)
    budget.observe_step(1, 0.4)
    assert budget.prune([tree], [0.1], rows, fixed_of({0}))[0].tokens == [1]
    figs = budget.to_dict()
    assert figs["steps_pruned"] == 1 and figs["nodes_removed"] == 2 and figs["loads_saved"] == 4
    assert budget.prune([tree, None], [0.1, 0.0], rows + [None], fixed_of({0}))[0] is tree  # bs 2


def test_before_any_wait_a_miss_is_priced_at_a_loads_own_time() -> None:
    # prefetches that all finish in time must not leave trees unpriced (CI saw 0 steps priced)
    budget = TreeBudget(decay=0.5)
    budget.observe_store(0.0, 0, sample=False, loads=4, load_seconds=0.2)  # prefill loads
    assert budget.load_s == pytest.approx(0.05)
    budget.observe_store(0.0, 0, loads=8, load_seconds=0.6)  # a decode step waited for none
    assert budget.load_s == pytest.approx(0.075)
    budget.observe_store(0.3, 1, loads=9, load_seconds=0.7)  # the first wait replaces the prior
    assert budget.load_s == pytest.approx(0.3)
    budget.observe_store(0.3, 1, loads=20, load_seconds=5.0)  # and loads no longer move it
    assert budget.load_s == pytest.approx(0.3)
    budget.observe_store(0.5, 2, loads=21, load_seconds=5.1)
    assert budget.load_s == pytest.approx(0.25)  # waits averaged (decay 0.5)


def test_flag_needs_a_routing_predictor_and_speculation() -> None:
    with pytest.raises(ValueError, match="--moe-prefetch-prune-tree"):
        ServerArgs(model_path="x", moe_expert_cache_slots=2, moe_prefetch_predictor="reuse",
                   speculative_algorithm="NGRAM", moe_prefetch_prune_tree=True)
    with pytest.raises(ValueError, match="--moe-prefetch-prune-tree"):
        ServerArgs(model_path="x", moe_expert_cache_slots=2, moe_prefetch_predictor="draft",
                   moe_prefetch_prune_tree=True)


def _dear_loads(sched, seconds: float) -> None:
    """Every expert load costs `seconds` more (a slow disk)."""
    source = sched.runner.model.expert_store.source
    read = source.read_into

    def slow(*a, read=read):
        time.sleep(seconds)
        return read(*a)

    source.read_into = slow


@pytest.mark.parametrize("topk", [1, 2])
def test_scheduler_prunes_dear_branches_and_output_is_unchanged(tiny_moe_dir, topk) -> None:
    """A draft unrelated to the target (a random Mixtral drafting for a random Qwen2-MoE)
    gets little accepted; with loads made dear, the pruning drops branches, and greedy
    output stays that of plain decoding; KV and expert slots end at baseline. (A sampled
    request runs too; its tokens depend on the tree's shape, its distribution does not:
    verification samples exactly on any tree, test_verify.py.)"""
    target, draft = tiny_moe_dir("qwen2_moe"), tiny_moe_dir("mixtral")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() for n in (9, 14)]
    n = 12
    params = [greedy(n), {"max_new_tokens": n, "temperature": 0.9, "sampling_seed": 7,
                          "ignore_eos": True}]
    ref_sched = make_scheduler(target)
    ref = run(ref_sched, prompts, params)
    ref_sched.check_all_free()
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                speculative_num_steps=3, speculative_eagle_topk=topk)
    if topk > 1:
        spec["speculative_num_draft_tokens"] = 6
    sched = make_scheduler(target, moe_expert_cache_slots=2, moe_prefetch_predictor="draft",
                           moe_prefetch_prune_tree=True, moe_prefetch_disable_gate=True, **spec)
    assert sched.tree_budget is not None
    _dear_loads(sched, 0.01)
    got = run(sched, prompts, params)
    assert got["0"][0] == ref["0"][0]
    assert len(got["1"][0]) == n
    figs = sched.moe_state()["moe_prefetch"]["tree_budget"]
    assert figs["steps"] > 0 and figs["nodes_removed"] > 0 and figs["loads_saved"] > 0, figs
    from sglang.srt.metrics.collector import TokenizerMetrics

    metrics = TokenizerMetrics("tiny")
    metrics.refresh(sched.moe_state())
    text = metrics.render()[0].decode()
    line = ('sglang:moe_tree_nodes_pruned{layer="all",model_name="tiny",predictor="draft"} '
            f'{float(figs["nodes_removed"])}')
    assert line in text
    sched.check_all_free()
    sched.runner.model.expert_store.close()
