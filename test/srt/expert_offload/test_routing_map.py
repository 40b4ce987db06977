"""RoutingMap: a draft of another width predicts the target's routing through a ridge map
learned online from (prefill logits, catch-up residuals) pairs; through the Scheduler with a
narrower dense draft for a tiny MoE, the output is unchanged and the map learns."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.predictors import DraftPredictor
from sglang.srt.expert_offload.routing.router_stack import RouterView
from sglang.srt.expert_offload.routing.route_map import RoutingMap
from sglang.srt.layers.moe.router import Router, RouterConfig
from sglang.test.scheduler_driver import greedy, make_scheduler, run

DRAFT_H, TARGET_H, E = 12, 64, 8  # TARGET_H >= prompt rows: gates fit exactly


def _linear_world(seed: int = 0):
    """Two target layers whose router logits are an exact linear function of the draft's
    residual at the matching draft layer."""
    g = torch.Generator().manual_seed(seed)
    true = {layer: torch.randn(DRAFT_H + 1, E, generator=g) for layer in (0, 1)}

    def logits(layer: int, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.ones(h.shape[0], 1)], 1) @ true[layer]

    return g, logits


def test_the_map_learns_a_linear_routing_and_stops_at_its_caps() -> None:
    g, logits = _linear_world()
    rm = RoutingMap([0, 1], {0: 0, 1: 1}, DRAFT_H, E, rel=1e-6, min_samples=32, refit=16,
                    max_samples=100, max_rows=60)
    h = {d: torch.randn(80, DRAFT_H, generator=g) for d in (0, 1)}
    rm.begin_pass([("a", 0, 80)])  # 80 prompt rows, the cap keeps the first 60
    for layer in (0, 1):
        rm.note_logits(layer, logits(layer, h[layer]))
    assert not rm.ready and len(rm._pending["a"]) == 60
    rm.note_draft(["a"] * 20, list(range(20)), {d: x[:20] for d, x in h.items()})
    assert rm.samples == 20 and not rm.ready  # below min_samples
    rm.note_draft(["a"] * 60, list(range(20, 80)), {d: x[20:] for d, x in h.items()})
    assert rm.samples == 60 and rm.ready and not rm._pending["a"]  # 60-79 were never logged
    test = torch.randn(3, 50, DRAFT_H, generator=g)[:2]
    pred = rm.logits(test)
    for j, layer in enumerate((0, 1)):
        want = logits(layer, test[j]).topk(2).indices.sort().values
        assert torch.equal(pred[j].topk(2).indices.sort().values, want)
    # a second prompt passes max_samples: the map stops collecting
    rm.begin_pass([("b", 0, 50)])
    for layer in (0, 1):
        rm.note_logits(layer, logits(layer, h[layer][:50]))
    rm.note_draft(["b"] * 50, list(range(50)), {d: x[:50] for d, x in h.items()})
    assert rm.samples == 110 and not rm.collecting
    rm.begin_pass([("c", 0, 5)])
    assert rm._pass is None
    rm.forget("b")
    assert "b" not in rm._pending


def test_a_narrower_draft_predicts_through_the_map_once_it_has_learned() -> None:
    """DraftPredictor with a draft of another width: the estimate until the map is ready,
    then the draft's own rows through the map (the exact top-k in a linear world)."""
    g, logits = _linear_world(1)
    gates = {}
    for layer in (0, 1):
        gates[layer] = Router(TARGET_H, RouterConfig(num_experts=E, top_k=2))
        gates[layer].weight.data.normal_()
    views = {layer: RouterView(layer, torch.nn.Identity(), gt, top_k=2)
             for layer, gt in gates.items()}
    pred = DraftPredictor(views, torch.nn.Embedding(50, TARGET_H), width=0)
    assert pred.use_draft_hidden(DRAFT_H, 2) and pred.wants_catch_up()
    rm = pred.routemap
    rm.rel, rm.min_samples = 1e-6, 40
    pred.begin_step(StepContext(["a"], [[3]], [True]))
    h = {d: torch.randn(2, DRAFT_H, generator=g) for d in (0, 1)}
    assert pred.on_draft_hidden(["a", "a"], [3, 7], h) == {}  # the map knows nothing yet
    assert pred.on_draft_level(StepContext(["a"], [[3, 7]], [True]))  # the estimate speaks
    # a prompt of 48 tokens: the target's prefill logs its router logits per row ...
    prompt = torch.randint(0, 50, (48,), generator=g).tolist()
    ctx = StepContext(["p"], [prompt], [False], [0])
    pred.before_verify(ctx)
    hp = {d: torch.randn(48, DRAFT_H, generator=g) for d in (0, 1)}
    for layer in (0, 1):
        # the router reads `normed`: make its logits those of the linear world
        normed = torch.randn(48, TARGET_H, generator=g)
        gates[layer].weight.data = torch.linalg.lstsq(
            normed, logits(layer, hp[layer])).solution.T.contiguous()
        pred.on_moe_input(layer, normed, normed, ctx)
    # ... and the draft's catch-up on the same tokens completes the pairs
    assert pred.on_draft_catch_up(["p"] * 48, list(range(48)), hp)
    assert rm.ready and rm.samples == 48
    pred.begin_step(StepContext(["a"], [[3]], [True]))
    got = pred.on_draft_hidden(["a", "a"], [3, 7], h)
    for layer in (0, 1):
        want = set(logits(layer, h[layer]).topk(2).indices.reshape(-1).tolist())
        assert set(got[layer]) == want
    rows = pred.row_experts(StepContext(["a"], [[3, 7]], [True], [5]))
    assert rows is not None and rows[1].shape == (2, 2, E) and int(rows[1].sum()) == 8


def test_a_verify_pass_pairs_its_draft_rows_with_their_logits() -> None:
    """Draft tokens of a verify whose residuals the draft computed are samples as soon as
    the target routes them (no catch-up): in a linear world the map they teach is exact.
    A token met twice in one pass is left out (one residual is kept per token id)."""
    g, logits = _linear_world(2)
    gates = {layer: Router(TARGET_H, RouterConfig(num_experts=E, top_k=2)) for layer in (0, 1)}
    for gate in gates.values():
        gate.weight.data.normal_(generator=g)
    views = {layer: RouterView(layer, torch.nn.Identity(), gt, top_k=2)
             for layer, gt in gates.items()}
    pred = DraftPredictor(views, torch.nn.Embedding(50, TARGET_H), width=0)
    assert pred.use_draft_hidden(DRAFT_H, 2)
    rm = pred.routemap
    rm.rel, rm.min_samples, rm.refit = 1e-9, 40, 1000
    start = 10
    for step in range(14):
        toks = torch.randperm(50, generator=g)[:4].tolist()
        if step == 3:
            toks[3] = toks[1]  # a repeat: neither row is a sample
        pred.begin_step(StepContext(["a"], [toks[:1]], [True]))
        h = {d: torch.randn(4, DRAFT_H, generator=g) for d in (0, 1)}
        pred.on_draft_hidden(["a"] * 4, toks, h)  # the chain's rows, root first
        ctx = StepContext(["a"], [toks], [True], [start])
        pred.before_verify(ctx)
        for layer in (0, 1):
            # the target's router reads `normed`: give it rows whose logits are the linear
            # world's for the residual the draft computed at the same row
            want = logits(layer, h[layer])
            normed = want @ torch.linalg.pinv(gates[layer].weight.data.T)
            pred.on_moe_input(layer, normed, normed, ctx)
        start += 2
    assert rm.samples == 13 * 4 + 2 and rm.ready
    test = torch.randn(2, 30, DRAFT_H, generator=g)
    got = rm.logits(test)
    for j, layer in enumerate((0, 1)):
        assert torch.allclose(got[j], logits(layer, test[j]), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("predictor", ["draft", "ensemble"])
def test_scheduler_with_a_narrower_draft_learns_the_map_and_changes_nothing(
        tiny_moe_dir, tmp_path, predictor) -> None:
    from sglang.test.fixtures import build_tiny_model

    target = tiny_moe_dir("qwen2_moe")
    draft = build_tiny_model("llama", str(tmp_path / "draft32"), hidden_size=32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() for n in (40, 36)]
    ref_sched = make_scheduler(target)
    ref = run(ref_sched, prompts, [greedy(10), greedy(10)])
    ref_sched.check_all_free()
    sched = make_scheduler(target, moe_expert_cache_slots=2, moe_prefetch_predictor=predictor,
                           moe_prefetch_disable_gate=True, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=draft, speculative_num_steps=3,
                           moe_prefetch_prune_tree=True)
    pred = sched.prefetcher.predictor
    rm = (pred if predictor == "draft" else pred.members[0]).routemap
    assert rm is not None and sched.spec.draft_kv.observer.catch_up_rows() > 0
    got = run(sched, prompts, [greedy(10), greedy(10)])
    for rid in ref:
        assert got[rid][0] == ref[rid][0], rid
    # every prompt token the target prefilled and the draft read is a sample, and so is
    # every draft token a verify pass routed whose residual the draft computed
    prompt_pairs = sum(len(p) for p in prompts)
    assert rm.samples > prompt_pairs, rm.samples
    assert rm.ready
    assert sched.moe_state()["moe_prefetch"]["tree_budget"]["steps"] > 0  # trees were priced
    sched.check_all_free()
    assert not rm._pending  # finished requests leave nothing behind
    sched.runner.model.expert_store.close()
