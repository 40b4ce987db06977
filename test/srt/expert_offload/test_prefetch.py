"""Expert prefetch (--moe-prefetch-predictor): bookkeeping on scripted routing traces, the
predictors' own logic, and, through the real Scheduler with a tiny MoE and few expert slots,
output identical to prefetch off for every predictor (greedy and seeded sampling, plain and
speculative) with every slot back to baseline."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.predictors import (PREDICTORS, DraftPredictor, EnsemblePredictor,
                                                  ExpertPredictor, ReusePredictor)
from sglang.srt.expert_offload.routing.router_stack import RouterView, route_rank
from sglang.srt.expert_offload.stats import PrefetchStats
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.expert_offload.routing.router_stack import RouterStack
from sglang.srt.layers.moe.router import Router, RouterConfig
from sglang.test.scheduler_driver import greedy, make_scheduler, run


def test_stats_on_a_scripted_trace() -> None:
    stats = PrefetchStats(expert_bytes=100)
    # step 1, layer 0: fetched {1,2,3}; the layer needs {2,3,4}; resident then: {2,3,5}
    stats.fetched(0, [1, 2])
    stats.fetched(0, [3])
    stats.used(0, needed=[2, 3, 4], resident=[2, 3, 5])
    # step 2, layer 0: nothing fetched; needs {5}, resident
    stats.used(0, needed=[5], resident=[5, 2])
    # layer 1: fetched {7}, unused; needs {6}, not resident
    stats.fetched(1, [7])
    stats.used(1, needed=[6], resident=[7])
    d = stats.to_dict()
    l0, l1, total = d["layers"]["0"], d["layers"]["1"], d["total"]
    assert (l0["uses"], l0["needed"], l0["in_time"]) == (2, 4, 3)
    assert l0["recall"] == pytest.approx(3 / 4)
    assert l0["precision"] == pytest.approx(2 / 3) and l0["overfetch"] == pytest.approx(1.5)
    assert (l0["bytes_fetched"], l0["bytes_fetched_used"]) == (300, 200)
    assert l1["recall"] == 0.0 and l1["precision"] == 0.0 and l1["overfetch"] is None
    assert total["recall"] == pytest.approx(3 / 5) and total["precision"] == pytest.approx(2 / 4)
    # a fetch counts against the next use of its layer only
    stats.used(1, needed=[7], resident=[7])
    assert stats.to_dict()["layers"]["1"]["fetched"] == 1


def test_stats_split_recall_into_the_predictor_and_the_fast_tier() -> None:
    """predicted_recall counts what the predictors named (loaded or already resident);
    recall_ceiling what `num_slots` slots could hold of each use; a skipped use (gate off)
    scores nothing and drops what was named for it."""
    stats = PrefetchStats(expert_bytes=1, num_slots=2)
    stats.predicted(0, [1, 2])
    stats.predicted(0, [2, 5])  # named twice: counted once
    stats.fetched(0, [5])
    stats.used(0, needed=[1, 2, 3], resident=[1, 2])
    fig = stats.to_dict()["layers"]["0"]
    assert (fig["predicted"], fig["predicted_used"], fig["reachable"]) == (3, 2, 2)
    assert fig["predicted_recall"] == pytest.approx(2 / 3)
    assert fig["predicted_overfetch"] == pytest.approx(3 / 2)
    assert fig["recall_ceiling"] == pytest.approx(2 / 3) and fig["recall"] == pytest.approx(2 / 3)
    stats.predicted(0, [4])
    stats.fetched(0, [4])
    stats.skip(0)
    stats.used(0, needed=[4], resident=[4])
    fig = stats.to_dict()["layers"]["0"]
    assert (fig["uses"], fig["predicted"], fig["fetched"]) == (2, 3, 1)
    assert fig["recall_ceiling"] == pytest.approx(3 / 4)


def test_reuse_predicts_last_routing_then_history() -> None:
    p = ReusePredictor(width=1)
    ctx = StepContext(["a"], [[1]], [False])
    assert p.begin_step(ctx) == {}
    p.on_routed(0, torch.tensor([[3, 1], [3, 2]]))
    assert p.begin_step(ctx) == {0: [3, 1, 2]}  # most used first, no history beyond
    p.on_routed(0, torch.tensor([[5, 3]]))
    ranked = p.begin_step(ctx)[0]
    assert ranked[:2] == [3, 5] and len(ranked) == 3 and ranked[2] in (1, 2)


def test_route_rank_covers_the_routers_choice() -> None:
    torch.manual_seed(0)
    cfg = RouterConfig(num_experts=8, top_k=2)
    gate = Router(16, cfg)
    gate.weight.data.normal_()
    norm = torch.nn.Identity()
    x = torch.randn(5, 16)
    chosen = set(gate(x).topk_ids.reshape(-1).tolist())
    ranked = route_rank(RouterView(0, norm, gate, 2), x, extra=0)
    assert set(ranked) == chosen
    wider = route_rank(RouterView(0, norm, gate, 2), x, extra=2)
    assert chosen < set(wider) and len(wider) <= 8


@pytest.mark.parametrize("scoring,norm_kind", [("softmax", "rms"), ("sigmoid", "rms"),
                                               ("softmax", "layer")])
def test_router_stack_routes_every_layer_as_each_router_would(scoring, norm_kind) -> None:
    """One batched pass over all layers names, per layer, what each router alone would
    (fetch: some row's top-k, most mass first), and keeps from eviction exactly the union
    of each row's top-(k + keep_extra). A layer with another expert count goes alone."""
    torch.manual_seed(1)
    hidden, views, xs = 16, {}, {}
    for layer, experts in ((0, 8), (1, 8), (3, 8), (5, 6)):
        cfg = RouterConfig(num_experts=experts, top_k=2, scoring=scoring,
                           correction_bias=scoring == "sigmoid")
        gate = Router(hidden, cfg)
        gate.weight.data.normal_()
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.data.normal_()  # negative scores are still chosen
        # RMSNorms run batched; any other norm (LayerNorm here) layer by layer
        norm = RMSNorm(hidden, eps=1e-6) if norm_kind == "rms" else torch.nn.LayerNorm(hidden)
        with torch.no_grad():
            norm.weight.normal_()
        views[layer] = RouterView(layer, norm, gate, top_k=2)
        xs[layer] = torch.randn(5, hidden)
    stack = RouterStack(views)
    assert stack.single == [5] and (stack._rms is not None) == (norm_kind == "rms")
    fetch, keep = stack.rank(xs, extra=0, keep_extra=1)
    for layer, view in views.items():
        with torch.no_grad():
            chosen = set(view.gate(view.norm(xs[layer])).topk_ids.reshape(-1).tolist())
        assert set(fetch[layer]) == chosen, layer
        assert fetch[layer] == route_rank(view, xs[layer], extra=0)
        wider = set(route_rank(view, xs[layer], extra=1))
        assert set(keep[layer]) == wider and chosen <= set(keep[layer])
        # each kept expert's mass: its score summed over the rows whose top-3 hold it
        with torch.no_grad():
            logits = view.norm(xs[layer]) @ view.gate.weight.T
            probs = (logits.softmax(-1) if view.gate.cfg.scoring != "sigmoid" else
                     logits.sigmoid() + view.gate.e_score_correction_bias)
            top = probs.topk(3, dim=-1)
        for e, m in keep[layer].items():
            want = float(top.values[top.indices == e].sum())
            assert m == pytest.approx(want, rel=1e-4, abs=1e-5), (layer, e)
    # a subset of the layers (a draft with fewer layers than the target)
    part, _ = stack.rank({1: xs[1], 3: xs[3]}, extra=0, keep_extra=0)
    assert part == {1: fetch[1], 3: fetch[3]}


def test_prefetch_never_evicts_what_the_predictor_keeps(tiny_moe_dir) -> None:
    """A load the predictor asks for takes a free slot or one whose expert the predictor
    does not expect the pass to use (keep_for), else it is dropped: swapping two likely
    experts costs a load and saves none."""
    from sglang.srt.expert_offload.prefetcher import ExpertPrefetcher
    from sglang.srt.model_loader.loader import load_model

    class Scripted(ExpertPredictor):
        def __init__(self):
            self.fetch, self.keep = {}, {}

        def begin_step(self, ctx):
            return self.fetch

        def keep_for(self, layer):
            return self.keep.get(layer, set())

    model, _ = load_model(tiny_moe_dir("mixtral"), dtype="float32", moe_expert_cache_slots=2)
    store = model.expert_store
    layer = store.layers()[0]
    pred = Scripted()
    pf = ExpertPrefetcher(store, pred, expert_bytes=1)
    ctx = StepContext(["a"], [[1]], [False])
    pred.fetch = {layer: [0, 1]}
    pf.begin_step(ctx)
    store.wait_loads()
    pf.on_routed(layer, torch.tensor([[0, 1]]))  # the pass used them: a new step begins
    pred.fetch, pred.keep = {layer: [2]}, {layer: {0, 1, 2}}
    pf.begin_step(ctx)
    store.wait_loads()
    assert store.resident(layer) == [0, 1]  # both kept: expert 2 was not loaded
    assert store.stats().layers[layer].dropped == 1  # and the store counts the refusal
    pf.on_routed(layer, torch.tensor([[0, 1]]))
    pred.keep = {layer: {1, 2}}
    pf.begin_step(ctx)
    store.wait_loads()
    assert store.resident(layer) == [1, 2]  # 0 was not expected: 2 took its slot
    store.check_idle()
    store.close()


def test_a_clearly_likelier_expert_takes_the_slot_of_a_kept_one(tiny_moe_dir) -> None:
    """With scores (the draft predictor's router mass), a kept expert yields its slot to a
    requested one SWAP_MARGIN times likelier, the least likely first; a near-equal does not
    displace it, and a kept expert without a score is never evicted."""
    from sglang.srt.expert_offload.slots import SWAP_MARGIN
    from sglang.srt.model_loader.loader import load_model

    model, _ = load_model(tiny_moe_dir("mixtral"), dtype="float32", moe_expert_cache_slots=2)
    store = model.expert_store
    layer = store.layers()[0]

    def fill(a, b):
        for e in (a, b):
            lease = store.acquire(layer, [e])
            store.release(lease)
        assert store.resident(layer) == sorted([a, b])

    fill(0, 1)
    near = 0.4 * SWAP_MARGIN * 0.99
    assert store.prefetch_experts(layer, [2], {0, 1}, {0: 1.0, 1: 0.4, 2: near}) == []
    assert store.prefetch_experts(layer, [2], {0, 1}, {0: 1.0, 1: 0.4, 2: 0.9}) == [2]
    store.wait_loads()
    assert store.resident(layer) == [0, 2]  # 1, the least likely, gave its slot
    # kept without a score: never evicted; not kept and unscored: the first to go
    assert store.prefetch_experts(layer, [3], {0, 2}, {3: 5.0}) == []
    assert store.prefetch_experts(layer, [3], {0}, {0: 1.0, 3: 1.5}) == [3]
    store.wait_loads()
    assert store.resident(layer) == [0, 3]
    store.check_idle()
    store.close()


def test_ensemble_interleaves_and_respects_budget() -> None:
    class Fixed(ExpertPredictor):
        def __init__(self, answer):
            self.answer = answer

        def begin_step(self, ctx):
            return self.answer

    ens = EnsemblePredictor([Fixed({0: [1, 2, 3]}), Fixed({0: [4, 1], 1: [9]})], budget=3)
    assert ens.begin_step(None) == {0: [1, 4, 2], 1: [9]}


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 3000, (n,), generator=g).tolist() * 3 for n in (6, 10)]


@pytest.mark.parametrize("spec", [None, "NGRAM", "STANDALONE"])
def test_every_predictor_changes_nothing(tiny_moe_dir, spec) -> None:
    folder = tiny_moe_dir("qwen2_moe")
    prompts, n = _prompts(), 10
    sampled = {"max_new_tokens": n, "temperature": 0.9, "sampling_seed": 5, "ignore_eos": True}
    params = [greedy(n), sampled]
    extra = {}
    if spec == "NGRAM":
        extra = dict(speculative_algorithm="NGRAM", speculative_num_steps=3,
                     speculative_num_draft_tokens=6)
    elif spec == "STANDALONE":  # the model drafts for itself: the draft hook is exercised
        extra = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=folder,
                     speculative_num_steps=3)
    ref_sched = make_scheduler(folder, **extra)
    ref = run(ref_sched, prompts, params)
    ref_sched.check_all_free()
    for name in PREDICTORS:
        # 2 slots = top-k: every layer runs with the fewest slots possible, so prefetches
        # race with the running layers' pinned experts all the time
        # width 1 where it shapes the fetch (draft runs its default calibrated cut)
        sched = make_scheduler(folder, moe_expert_cache_slots=2, moe_prefetch_predictor=name,
                               moe_prefetch_width=0 if name == "draft" else 1, **extra)
        levels = []
        if spec == "STANDALONE" and sched.prefetcher is not None:
            hook = sched.prefetcher.on_draft_level
            sched.prefetcher.on_draft_level = lambda ctx: (levels.append(ctx), hook(ctx))
        got = run(sched, prompts, params)
        if spec == "STANDALONE" and name != "none":
            # the drafted tokens reach the predictor while the draft still runs (levels
            # 1 and 2 of 3), each request's root first
            assert levels and all(len(t) >= 2 for ctx in levels for t in ctx.tokens)
        for rid in ref:
            assert got[rid][0] == ref[rid][0], (name, rid)
        sched.check_all_free()  # KV, requests and expert slots (no pin, no load in flight)
        store = sched.runner.model.expert_store
        info = sched.moe_state()
        if name == "none":
            assert "moe_prefetch" not in info
        else:
            figs = info["moe_prefetch"]
            assert figs["predictor"] == name
            assert 0.0 <= figs["total"]["recall"] <= 1.0
            assert figs["total"]["uses"] > 0, figs["total"]
            if name in ("layer_ahead", "ensemble"):  # routers see new rows: loads happen
                assert figs["total"]["fetched"] > 0, figs["total"]
            assert set(figs["layers"]) == {str(i) for i in store.layers()}
        store.close()


def test_draft_predictor_routes_drafted_tokens_without_touching_its_state() -> None:
    """on_draft_level and begin_step only predict; the residual state that before_verify
    prepares (and the verify pass fills) is untouched by them."""
    torch.manual_seed(0)
    hidden, experts = 16, 8
    gate = Router(hidden, RouterConfig(num_experts=experts, top_k=2))
    gate.weight.data.normal_()
    views = {0: RouterView(0, torch.nn.Identity(), gate, top_k=2)}
    embed = torch.nn.Embedding(50, hidden)
    pred = DraftPredictor(views, embed, width=0)
    ctx = StepContext(["a"], [[3, 7, 9]], [True])
    level = pred.on_draft_level(ctx)
    assert pred.begin_step(StepContext(["a"], [[3]], [True]))[0]
    assert not pred.state and pred._rows is None  # nothing prepared for a pass
    assert level == pred.before_verify(ctx)  # same tokens, same prediction
    assert set(level[0]) <= set(range(experts)) and len(level[0]) >= 2
    assert pred.state["a"][0] == 3  # before_verify keeps the root's row for the pass


def test_draft_predictor_routes_the_drafts_own_residuals() -> None:
    """A draft as wide as the target hands its residual stream per layer: a token the draft
    computed is routed from its own residual (exactly the router's choice for it), one it
    did not (the tree's last level) from the latest drafted residual with the embeddings
    swapped. A draft of another width goes through a RoutingMap (test_route_map.py)."""
    torch.manual_seed(0)
    hidden, experts = 16, 8
    gates = {}
    for layer in (0, 1):
        gates[layer] = Router(hidden, RouterConfig(num_experts=experts, top_k=2))
        gates[layer].weight.data.normal_()
    views = {layer: RouterView(layer, torch.nn.Identity(), g, top_k=2) for layer, g in gates.items()}
    embed = torch.nn.Embedding(50, hidden)
    pred = DraftPredictor(views, embed, width=0)
    assert pred.use_draft_hidden(hidden + 1, 2) and pred.routemap is not None
    assert pred.use_draft_hidden(hidden, 2) and pred.layer_map == {0: 0, 1: 1}
    assert pred.routemap is None
    pred.begin_step(StepContext(["a"], [[3]], [True]))
    assert pred.on_draft_level(StepContext(["a"], [[3, 7]], [True])) == {}  # no estimate
    res = {layer: torch.randn(2, hidden) for layer in (0, 1)}  # rows: root 3, node 7
    got = pred.on_draft_hidden(["a", "a"], [3, 7], res)
    chosen = lambda layer, x: set(gates[layer](x).topk_ids.reshape(-1).tolist())
    for layer in (0, 1):
        assert set(got[layer]) == chosen(layer, res[layer])
    out = pred.before_verify(StepContext(["a"], [[3, 7, 9]], [True]))
    with torch.no_grad():
        for layer in (0, 1):
            last = res[layer][1] - embed.weight[7] + embed.weight[9]  # node 9: not drafted
            assert set(out[layer]) == chosen(layer, torch.stack([res[layer][0], res[layer][1], last]))


def test_draft_residuals_predict_the_verify_better_than_the_estimate(tiny_moe_dir) -> None:
    """Through the scheduler, a tiny MoE drafting for itself: the experts the `draft`
    predictor names before each verify cover what the verify routes to far better from the
    draft's own residuals than from the estimate (previous step's residual, embeddings
    swapped), and the output is the same either way."""
    folder = tiny_moe_dir("qwen2_moe")
    prompts = _prompts()
    outs, cover = {}, {}
    for mode in ("hidden", "estimate"):
        # the fixed rule (min_prob 0): each row's top-k, so coverage scores the rows' source
        # (a probability cut on 8 experts names nearly all of them either way)
        sched = make_scheduler(folder, moe_expert_cache_slots=4, moe_prefetch_predictor="draft",
                               moe_prefetch_width=0, moe_prefetch_min_prob=0.0,
                               speculative_algorithm="STANDALONE",
                               speculative_draft_model_path=folder, speculative_num_steps=3,
                               moe_prefetch_disable_gate=True)  # every verify predicted
        observer, pred = sched.spec.draft_kv.observer, sched.prefetcher.predictor
        assert observer.wants_hidden()  # same width: wired by the scheduler
        if mode == "estimate":
            observer.hidden, pred.layer_map = False, {}
        pending, hits = {}, [0, 0]
        verify, routed = pred.before_verify, pred.on_routed

        def before_verify(ctx, verify=verify, pending=pending):
            out = verify(ctx)
            pending.clear()
            if any(ctx.is_tree):
                pending.update({layer: set(e) for layer, e in out.items()})
            return out

        def on_routed(layer, topk_ids, routed=routed, pending=pending, hits=hits):
            if layer in pending:
                needed = set(topk_ids.reshape(-1).tolist())
                hits[0] += len(needed & pending.pop(layer))
                hits[1] += len(needed)
            return routed(layer, topk_ids)

        pred.before_verify, pred.on_routed = before_verify, on_routed
        outs[mode] = {k: v[0] for k, v in run(sched, prompts, [greedy(12)] * 2).items()}
        cover[mode] = hits[0] / max(1, hits[1])
        sched.check_all_free()
        sched.runner.model.expert_store.close()
    assert outs["hidden"] == outs["estimate"]
    assert cover["hidden"] > cover["estimate"] + 0.1, cover


def test_keep_width_reaches_the_predictor_and_is_checked(tiny_moe_dir) -> None:
    """--moe-prefetch-keep-width goes from ServerArgs to the draft predictor (0: protect
    only the fetched experts); a negative value is refused with the flag's name."""
    from sglang.srt.server_args import ServerArgs

    folder = tiny_moe_dir("qwen2_moe")
    with pytest.raises(ValueError, match="--moe-prefetch-keep-width must be >= 0"):
        ServerArgs(model_path=folder, moe_prefetch_keep_width=-1)
    for width in (0, 2):
        sched = make_scheduler(folder, moe_expert_cache_slots=4, moe_prefetch_predictor="draft",
                               moe_prefetch_keep_width=width, moe_prefetch_min_prob=0.0)
        assert sched.prefetcher.predictor.keep_width == width
        sched.runner.model.expert_store.close()
