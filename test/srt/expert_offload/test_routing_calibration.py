"""Calibrated prefetch cut (--moe-prefetch-min-prob, expert_offload/routing/calibration.py): rates
per (row source, layer, predicted rank) learned from scripted routings, the pass probability
of several rows, the cut, and through the real Scheduler: output unchanged, the calibration
learns from the verify passes, and a higher cut fetches less."""

from __future__ import annotations

import warnings

import pytest
import torch

from sglang.srt.expert_offload.routing.calibration import (BACK, OWN, RankCalibration, prior_rates,
                                                      select)
from sglang.test.scheduler_driver import greedy, make_scheduler, run


@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4), (4, 2), (64, 6)])
def test_the_prior_sums_to_top_k_and_favours_the_head(experts, top_k) -> None:
    rates = prior_rates(experts, top_k)
    assert rates.sum().item() == pytest.approx(top_k)
    assert bool((rates[:-1] >= rates[1:]).all())  # never likelier further down the ranking


def test_rates_learn_each_ranks_hit_rate_per_layer_and_source() -> None:
    """Rows of source OWN at layer 3: the top-ranked expert is always chosen, rank 1 half the
    time, rank 2 the other half. After 400 rows the rates approach (1, .5, .5, 0, ...); the
    unobserved source BACK stays at the prior; layer 5 (no rows) takes layer 3's pooled
    rates for OWN, shrunk toward the prior."""
    cal = RankCalibration([3, 5], num_experts=8, top_k=2)
    scores = torch.tensor([[0.9, 0.5, 0.4, 0.1, 0.05, 0.03, 0.02, 0.01]]).repeat(400, 1)
    perm = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])  # expert ids need not follow ranks (and
    # the permutation is not its own inverse: ranks and orders must not be confused)
    scores = scores[:, torch.argsort(perm)]  # expert perm[r] has rank r
    topk = torch.tensor([[perm[0], perm[1 + (i % 2)]] for i in range(400)])
    cal.observe(3, scores, torch.full((400,), OWN), topk)
    rates = cal.rates()
    own3 = rates[OWN, 0]
    assert own3[0].item() == pytest.approx(1.0, abs=0.02)
    assert own3[1].item() == pytest.approx(0.5, abs=0.02)
    assert own3[2].item() == pytest.approx(0.5, abs=0.02)
    assert own3[3:].max().item() < 0.02
    assert torch.allclose(rates[BACK, 0], prior_rates(8, 2))
    own5 = rates[OWN, 1]  # the pooled OWN rate (close to layer 3's), not the prior
    assert own5[2].item() == pytest.approx(0.5, abs=0.05)
    # rows whose count does not match the routing are ignored (another pass ran)
    cal.observe(3, scores[:2], torch.full((2,), OWN), topk[:3])
    assert cal.rows[OWN, 0].item() == 400


def test_a_pass_uses_an_expert_if_any_row_does() -> None:
    cal = RankCalibration([0], num_experts=4, top_k=1)
    # rates by rank: learn exactly (0.6, 0.3, 0.1, 0); orders that are not their own
    # inverse, so a rank taken for an order (or back) shows
    scores = torch.tensor([[0.5, 0.05, 0.9, 0.2]])  # ranks: expert 2, 0, 3, 1
    for chosen, count in ((2, 600), (0, 300), (3, 100)):
        cal.observe(0, scores.repeat(count, 1), torch.full((count,), OWN),
                    torch.full((count, 1), chosen))
    cal.layer_weight = cal.pool_weight = 1e-9  # no shrinkage: the rates are the counts
    cal._rates = None
    # row 2 ranks: expert 1, 3, 0, 2
    two = torch.stack([scores[0], torch.tensor([0.2, 0.9, 0.05, 0.5])])
    p = cal.pass_probs([0], two[None], torch.tensor([OWN, OWN]))[0]
    rate = {0: 0.6, 1: 0.3, 2: 0.1, 3: 0.0}
    both = lambda a, b: 1 - (1 - rate[a]) * (1 - rate[b])
    # expert e: its rank in row 1 and in row 2
    assert p[2].item() == pytest.approx(both(0, 3), abs=1e-6)
    assert p[0].item() == pytest.approx(both(1, 2), abs=1e-6)
    assert p[3].item() == pytest.approx(both(2, 1), abs=1e-6)
    assert p[1].item() == pytest.approx(both(3, 0), abs=1e-6)


def test_select_cuts_at_the_probability_and_keeps_down_to_half_of_it() -> None:
    probs = torch.tensor([[0.05, 0.9, 0.3, 0.12, 0.5],
                          [0.0, 0.0, 0.0, 0.0, 0.19]], dtype=torch.float64)
    fetch, keep = select([4, 9], -torch.log1p(-probs), 0.2)
    assert fetch == {4: [1, 4, 2], 9: []}
    assert set(keep[4]) == {1, 4, 2, 3} and keep[4][3] == pytest.approx(0.12)
    assert set(keep[9]) == {4}


def test_the_calibrated_cut_through_the_scheduler(tiny_moe_dir) -> None:
    """The tiny MoE drafting for itself with --moe-prefetch-min-prob: greedy output equals
    prefetch off; the calibration scores every verify pass's rows (most from the draft's own
    residuals) and is shown in /server_info; a higher cut names fewer experts; the flag is
    checked; slots and KV return to baseline."""
    from sglang.srt.server_args import ServerArgs

    folder = tiny_moe_dir("qwen2_moe")
    with pytest.raises(ValueError, match="--moe-prefetch-min-prob must be in"):
        ServerArgs(model_path=folder, moe_prefetch_min_prob=1.5)
    slots = dict(moe_expert_cache_slots=4, moe_prefetch_predictor="draft")
    with pytest.warns(UserWarning, match="add --moe-prefetch-min-prob 0"):
        ServerArgs(model_path=folder, moe_prefetch_keep_width=2, **slots)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fixed rule: the width flags do apply
        ServerArgs(model_path=folder, moe_prefetch_keep_width=2, moe_prefetch_min_prob=0,
                   **slots)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() * 3 for n in (6, 10)]
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=folder,
                speculative_num_steps=3)
    ref_sched = make_scheduler(folder, **spec)
    ref = run(ref_sched, prompts, [greedy(12)] * 2)
    ref_sched.check_all_free()
    named = {}
    for cut in (0.05, 0.6):
        sched = make_scheduler(folder, moe_expert_cache_slots=4, moe_prefetch_predictor="draft",
                               moe_prefetch_min_prob=cut, moe_prefetch_disable_gate=True, **spec)
        pred = sched.prefetcher.predictor
        assert pred.min_prob == cut and pred.calibration is not None
        got = run(sched, prompts, [greedy(12)] * 2)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
        cal = pred.calibration
        assert cal.rows[OWN].sum() > 0 and cal.rows[OWN].sum() >= cal.rows[BACK].sum()
        info = sched.moe_state()["moe_prefetch"]
        assert set(info["calibration"]) >= {"own"} and len(info["calibration"]["own"]) == 8
        named[cut] = info["total"]["predicted"] / info["total"]["uses"]
        sched.check_all_free()
        sched.runner.model.expert_store.close()
    assert named[0.6] < named[0.05], named


def test_the_cut_routes_only_what_it_can_score() -> None:
    """A draft of the target's width hands its own residuals: under the cut, begin_step does
    not fetch the roots from the (unscored) estimate; the fixed rule still does. Rows the
    draft computed are OWN, the last level one token back BACK, and the verify scores them."""
    from sglang.srt.expert_offload.messages import StepContext
    from sglang.srt.expert_offload.predictors import DraftPredictor
    from sglang.srt.expert_offload.routing.router_stack import RouterView
    from sglang.srt.layers.moe.router import Router, RouterConfig

    torch.manual_seed(0)
    hidden = 16
    gates = {layer: Router(hidden, RouterConfig(num_experts=8, top_k=2)) for layer in (0, 1)}
    for g in gates.values():
        g.weight.data.normal_()
    views = {x: RouterView(x, torch.nn.Identity(), g, top_k=2) for x, g in gates.items()}
    embed = torch.nn.Embedding(50, hidden)
    fixed = DraftPredictor(views, embed, width=0)
    cut = DraftPredictor(views, embed, width=0, min_prob=0.3)
    for pred in (fixed, cut):
        assert pred.use_draft_hidden(hidden, 2)
        pred.before_verify(StepContext(["a"], [[3]], [False]))  # a state for the estimate
        for layer in (0, 1):
            pred.on_moe_input(layer, None, torch.randn(1, hidden), None)
    assert fixed.begin_step(StepContext(["a"], [[3]], [True]))
    assert cut.begin_step(StepContext(["a"], [[3]], [True])) == {}
    res = {layer: torch.randn(2, hidden) for layer in (0, 1)}
    assert cut.on_draft_hidden(["a", "a"], [3, 7], res)  # the draft's rows: fetched
    out = cut.before_verify(StepContext(["a"], [[3, 7, 9]], [True]))
    assert set(out) == {0, 1}
    assert cut._pass[0] == [0, 1] and cut._pass[2].tolist() == [OWN, OWN, BACK]
    for layer in (0, 1):
        cut.on_routed(layer, gates[layer](torch.randn(3, hidden)).topk_ids)
    assert cut.calibration.rows[OWN].tolist() == [2.0, 2.0]
    assert cut.calibration.rows[BACK].tolist() == [1.0, 1.0] and cut._pass is None


def test_the_server_default_is_the_measured_cut() -> None:
    """The default is written once (ServerArgs) and reaches the offload config: 0.4, the
    cut measured in docs/decisions.md."""
    from sglang.srt.expert_offload.config import OffloadConfig
    from sglang.srt.server_args import ServerArgs

    assert OffloadConfig.from_server_args(ServerArgs(model_path="x")).min_prob == 0.4


def test_scoring_layers_in_one_batch_equals_one_by_one() -> None:
    """observe_layers (what a pass uses) counts exactly what per-layer observe does."""
    g = torch.Generator().manual_seed(2)
    one, many = (RankCalibration([2, 4, 6], num_experts=8, top_k=2) for _ in range(2))
    scores = torch.rand(3, 5, 8, generator=g)
    topk = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(15)]).view(3, 5, 2)
    sources = torch.tensor([OWN, BACK, OWN, 2, BACK])
    for i, layer in enumerate((2, 4, 6)):
        one.observe(layer, scores[i], sources, topk[i])
    many.observe_layers([2, 4, 6], scores, sources, topk)
    assert torch.equal(one.hits, many.hits) and torch.equal(one.rows, many.rows)
    assert one.hits.sum().item() == 15 * 2  # every row: its 2 chosen experts, each at a rank
