"""HYBRID drafting: n-gram and draft-model trees merged under one budget, weighted by each
drafter's recent acceptance for the request; greedy output equals plain decoding."""

from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.speculative.drafters.base import Drafter
from sglang.srt.speculative.drafters.hybrid import DrafterWeights, merge_trees
from sglang.srt.speculative.tree import DraftTree
from sglang.test.scheduler_driver import greedy, make_scheduler, run



def prompts(batch: int, seed: int):
    """Random token runs repeated 3 times: the n-gram side has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        n = int(torch.randint(3, 12, (1,), generator=g))
        out.append(torch.randint(3, 3000, (n,), generator=g).tolist() * 3)
    return out


def chain(root: int, tokens, probs) -> DraftTree:
    tree = DraftTree.root_only(root)
    parent, score = 0, 0.0
    for t, p in zip(tokens, probs):
        score += math.log(p)
        parent = tree.add(t, parent, score)
    return tree


def paths(tree: DraftTree):
    out, ps = set(), [()]
    for i in range(1, len(tree)):
        ps.append(ps[tree.parents[i]] + (tree.tokens[i],))
        out.add(ps[-1])
    return out


def test_merge_shares_common_paths_and_records_origins() -> None:
    model = chain(1, [5, 6, 7], [0.9, 0.9, 0.9])
    ngram = chain(1, [5, 8], [1.0, 1.0])
    tree, origins = merge_trees(1, {"model": model, "ngram": ngram},
                                {"model": 0.5, "ngram": 0.5}, budget=10)
    assert paths(tree) == {(5,), (5, 6), (5, 6, 7), (5, 8)}  # (5,) is one node, not two
    by_path = dict(zip([()] + sorted(paths(tree), key=len), [None] * 5))
    ps = [()]
    for i in range(1, len(tree)):
        ps.append(ps[tree.parents[i]] + (tree.tokens[i],))
        by_path[ps[-1]] = origins[i]
    assert by_path[(5,)] == {"model", "ngram"}
    assert by_path[(5, 8)] == {"ngram"} and by_path[(5, 6, 7)] == {"model"}
    for i in range(1, len(tree)):  # scores never increase along a path
        assert tree.scores[i] <= tree.scores[tree.parents[i]] + 1e-12


def test_weights_decide_what_fits_the_budget() -> None:
    model = chain(1, [5, 6, 7], [0.9, 0.9, 0.9])
    ngram = chain(1, [9, 8, 3], [1.0, 1.0, 1.0])
    lean_ngram, _ = merge_trees(1, {"model": model, "ngram": ngram},
                                {"model": 0.1, "ngram": 0.9}, budget=4)
    lean_model, _ = merge_trees(1, {"model": model, "ngram": ngram},
                                {"model": 0.9, "ngram": 0.1}, budget=4)
    assert paths(lean_ngram) == {(9,), (9, 8), (9, 8, 3)}
    assert paths(lean_model) == {(5,), (5, 6), (5, 6, 7)}
    alone, origins = merge_trees(1, {"model": None, "ngram": ngram}, {"model": 0.5, "ngram": 0.5}, 3)
    assert len(alone) == 3 and all(o == {"ngram"} for o in origins[1:])


def test_weights_follow_credit_and_keep_a_floor() -> None:
    w = DrafterWeights()
    assert w.weights()["model"] == pytest.approx(0.5)
    for _ in range(20):
        w.update({"ngram": 4, "model": 0})  # copied text: n-gram nodes accepted
    assert w.weights()["ngram"] > 0.9 and w.weights()["model"] >= 0.04
    for _ in range(20):
        w.update({"ngram": 0, "model": 3})  # prose: the draft model wins it back
    assert w.weights()["model"] > 0.9


@pytest.mark.parametrize("draft", ["same", "unrelated"])
@pytest.mark.parametrize("batch", [1, 3])
def test_hybrid_is_lossless(tiny_llama_dir, tiny_draft_dir, draft, batch) -> None:
    ps = prompts(batch, seed=40 + batch)
    plain = make_scheduler(tiny_llama_dir)
    ref = run(plain, ps, [greedy(30)] * batch)
    draft_dir = tiny_llama_dir if draft == "same" else tiny_draft_dir
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                           speculative_draft_model_path=draft_dir, speculative_num_steps=3,
                           speculative_num_draft_tokens=8)
    got = run(sched, ps, [greedy(30)] * batch)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    for _, upd in got.values():
        weights = upd.extra_meta["spec_drafter_weights"]
        assert sum(weights.values()) == pytest.approx(1.0)
        if draft == "same":  # the draft model is always right: it keeps the larger weight
            assert weights["model"] >= weights["ngram"]
            assert upd.extra_meta["spec_accept_length"] > 1.5
    sched.check_all_free()


# The n-grams continue this text (7 -> 5, 6, 7) from a 3-token match: not a quote, so the
# draft model's turn is decided by its EMA (a quote, [5, 6, 7, 8, 9] * 4, skips it outright).
SHORT_MATCH = [1, 2, 3, 4, 5, 6, 7, 5, 6, 7]


class AskedModel(Drafter):
    """A stand-in draft model that records who asked it and proposes the branch 1, 2."""

    def __init__(self):
        self.asked = []

    def propose(self, reqs, budgets, depth=None):
        self.asked += [r.rid for r in reqs]
        return [chain(r.fill_ids[-1], [1, 2], [0.5, 0.5]) for r in reqs]


def test_draft_model_sits_out_while_ngrams_carry_the_text() -> None:
    """Once the n-grams carry a request (model weight at the floor), the draft model is
    asked only in probes, the first after `probe_every` steps and each wait twice the last
    (a probe that finds nothing costs a draft step); a request with no n-gram match always
    asks it."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    class Counting(Drafter):  # a stand-in draft model that proposes nothing
        def __init__(self):
            self.asked = []

        def propose(self, reqs, budgets, depth=None):
            self.asked.append([r.rid for r in reqs])
            return [None] * len(reqs)

    model = Counting()
    hybrid = HybridDrafter(NgramDrafter(max_depth=4), model, probe_every=4)
    copied = SimpleNamespace(rid="copied", fill_ids=SHORT_MATCH, cached_tokens=0)
    fresh = SimpleNamespace(rid="fresh", fill_ids=[1, 2, 3, 4], cached_tokens=0)
    for _ in range(30):
        hybrid.weights.setdefault("copied", DrafterWeights()).update({"ngram": 4, "model": 0})
    for _ in range(28):
        hybrid.propose([copied, fresh], [5, 5])
    probes = [k + 1 for k, a in enumerate(model.asked) if "copied" in a]
    assert probes == [4, 12, 28]  # waits of 4, 8, 16 steps
    assert all("fresh" in a for a in model.asked) and len(model.asked) == 28


def test_draft_model_sits_out_while_it_only_repeats_the_ngrams() -> None:
    """Quoting: the draft model proposes what the n-grams propose, so both are credited and
    the weights stay even while it runs; it is skipped all the same (it adds no token of its
    own), and asked again every step once it brings accepted tokens the n-grams missed."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    class Echo(Drafter):  # a draft model that continues the text as the n-grams do
        def __init__(self, follow):
            self.asked, self.follow = 0, follow

        def propose(self, reqs, budgets, depth=None):
            self.asked += 1
            return [chain(r.fill_ids[-1], self.follow(r), [0.9] * 3) for r in reqs]

    text = SHORT_MATCH
    model = Echo(lambda r: [5, 6, 7])
    hybrid = HybridDrafter(NgramDrafter(max_depth=4), model, probe_every=4)
    req = SimpleNamespace(rid="q", fill_ids=text, cached_tokens=0)
    for _ in range(12):
        tree = hybrid.propose([req], [6])[0]
        hybrid.on_verified(req, list(range(len(tree))))  # a chain: every node accepted
    assert model.asked <= 6  # the first steps, then probes only

    model.asked = 0  # the model now proposes what the n-grams do not, and it is accepted
    model.follow = lambda r: [1, 2, 3]
    for _ in range(12):
        tree = hybrid.propose([req], [6])[0]
        ps = [()]
        for i in range(1, len(tree)):
            ps.append(ps[tree.parents[i]] + (tree.tokens[i],))
        hybrid.on_verified(req, [0] + [i for i in range(1, len(tree)) if ps[i][0] == 1])
    assert model.asked >= 8  # a probe found it useful: asked every step again
    hybrid.release(req)


def test_held_back_requests_get_ngram_trees_without_the_model() -> None:
    """A request the draft model is held back for (its KV not worth catching up) is drafted
    by the n-grams alone; the others still ask the model."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    model = AskedModel()
    hybrid = HybridDrafter(NgramDrafter(max_depth=4), model)
    behind = SimpleNamespace(rid="behind", fill_ids=[5, 6, 7, 8, 9] * 4, cached_tokens=0)
    level = SimpleNamespace(rid="level", fill_ids=SHORT_MATCH, cached_tokens=0)
    hybrid.hold_back({"behind"})
    got = dict(zip(["behind", "level"], hybrid.propose([behind, level], [5, 7])))
    assert model.asked == ["level"]
    assert paths(got["behind"]) == {(5,), (5, 6), (5, 6, 7), (5, 6, 7, 8)}
    assert (1,) in paths(got["level"])  # the model's branch beside the n-grams'
    for r in (behind, level):
        hybrid.release(r)
    hybrid.check_all_free()


def test_a_tree_holds_the_ngrams_own_rows_plus_the_draft_models_nodes() -> None:
    """With the draft model asked, a request's tree holds what its n-grams alone may fill
    (their own draft length) plus the model's nodes, not the step's whole budget: each
    draft-model step had verified 10 rows (3-4 plain steps on AVX2) for one or two tokens.
    Held back, the n-grams alone keep their own length; without one, the step's budget."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    model = AskedModel()  # proposes the chain 1, 2: two nodes
    hybrid = HybridDrafter(NgramDrafter(max_depth=8), model)
    text = [9, 8, 5, 6, 7, 3, 4, 11, 12, 9, 8, 5, 6, 7, 3, 4, 13, 9, 8]
    req = SimpleNamespace(rid="prose", fill_ids=text, cached_tokens=0)
    hybrid.hold_back(set())
    whole = hybrid.propose([req], [10])[0]
    assert len(whole) > 5  # the n-grams' deep path beside the model's: the case it is for
    hybrid.hold_back(set(), {"prose": 2})  # its n-grams alone: one draft token
    capped = hybrid.propose([req], [10])[0]
    assert model.asked == ["prose", "prose"]
    assert len(capped) == 2 + 2 and paths(capped) <= paths(whole)  # the best of the same
    hybrid.hold_back({"prose"}, {"prose": 2})
    assert len(hybrid.propose([req], [2])[0]) <= 2 and model.asked == ["prose", "prose"]
    hybrid.release(req)
    hybrid.check_all_free()


def test_a_model_whose_nodes_lose_their_place_is_judged_all_the_same() -> None:
    """The draft model ran but the n-grams' nodes filled the tree: it cost a step and
    added nothing, so it sits out after its first steps (its record had never moved)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    model = AskedModel()  # its chain 1, 2 at 0.5 a level: below the n-grams' path
    hybrid = HybridDrafter(NgramDrafter(max_depth=8), model, probe_every=4)
    text = [9, 8, 5, 6, 7, 3, 4, 11, 12, 9, 8, 5, 6, 7, 3, 4, 13, 9, 8]
    req = SimpleNamespace(rid="prose", fill_ids=text, cached_tokens=0)
    for _ in range(16):
        hybrid.hold_back(set(), {"prose": 1})  # room for the model's two nodes, no more
        tree = hybrid.propose([req], [10])[0]
        assert len(tree) <= 3 and (1,) not in paths(tree)
        hybrid.on_verified(req, [0])
    assert 2 <= len(model.asked) <= 5, model.asked
    hybrid.release(req)
    hybrid.check_all_free()


def test_a_model_that_brings_nothing_sits_out_where_the_ngrams_found_nothing() -> None:
    """Prose with no n-gram match: the draft model's own record decides there too. One
    whose drafts are never taken is asked for its first steps and then only in probes
    (it had run at every such step); one whose drafts are taken is asked every step."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    for taken, expect in ((False, lambda n: 2 <= n <= 5), (True, lambda n: n == 16)):
        model = AskedModel()
        hybrid = HybridDrafter(NgramDrafter(max_depth=4), model, probe_every=4)
        req = SimpleNamespace(rid="prose", fill_ids=list(range(100, 120)), cached_tokens=0)
        for _ in range(16):
            tree = hybrid.propose([req], [4])[0]
            hybrid.on_verified(req, [0, 1] if taken and tree is not None else [0])
        assert expect(len(model.asked)), (taken, len(model.asked))
        hybrid.release(req)
        hybrid.check_all_free()


def test_draft_model_sits_out_while_the_ngrams_quote() -> None:
    """A request quoting its context (a long backward match, a deep likely n-gram path) is
    drafted by the n-grams alone from its first step, with no probes; one whose n-grams only
    match a few tokens back asks the draft model."""
    from types import SimpleNamespace

    from sglang.srt.speculative.drafters.hybrid import HybridDrafter
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    model = AskedModel()
    ngram = NgramDrafter(max_depth=6)
    hybrid = HybridDrafter(ngram, model, probe_every=4)
    quote = SimpleNamespace(rid="quote", fill_ids=[5, 6, 7, 8, 9] * 4, cached_tokens=0)
    prose = SimpleNamespace(rid="prose", fill_ids=SHORT_MATCH, cached_tokens=0)
    for _ in range(12):
        got = dict(zip(["quote", "prose"], hybrid.propose([quote, prose], [7, 7])))
    assert "quote" not in model.asked and "prose" in model.asked
    assert ngram.match_len["quote"] >= hybrid.sure_match > ngram.match_len["prose"]
    assert (5, 6, 7, 8, 9) in paths(got["quote"])  # the quoted passage, deeper than 3 steps
    for r in (quote, prose):
        hybrid.release(r)
    hybrid.check_all_free()


def test_request_with_the_draft_model_off_is_drafted_by_ngrams_alone(
        tiny_llama_dir, tiny_draft_dir) -> None:
    """The fallback's first stage (controller.model_off) holds the draft model back for that
    request; its verifies are priced as n-gram ones, its output is plain's."""
    from sglang.srt.speculative.controller import expected_tokens
    from sglang.srt.speculative.request_decisions import verify_cost_prior

    ps = [[5, 6, 7, 8, 9] * 6 + [11, 12, 13], [21, 22, 23, 24] * 6]
    ref = run(make_scheduler(tiny_llama_dir), ps, [greedy(24)] * 2)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                           speculative_draft_model_path=tiny_draft_dir,
                           speculative_num_steps=3, speculative_num_draft_tokens=8,
                           speculative_fallback_threshold=0.5)
    spec = sched.spec
    propose, record = spec.propose, spec.record
    ran: dict = {}
    prices: dict = {}

    def traced_propose(reqs):
        for r in reqs:
            ctl = spec.controller(r)
            if r.rid == "0":
                ctl.model_off, ctl.model_left = True, 10 ** 6
        out = propose(reqs)
        for r in reqs:
            ran.setdefault(r.rid, []).append(spec.drafter.model_ran_for(r))
        return out

    def traced_record(req, offered, accepted, emitted):
        if offered:
            free = spec.proposal.break_even or verify_cost_prior(offered + 1)
            model = expected_tokens(0.5, min(3, offered))
            prices.setdefault(req.rid, []).append(
                (spec.decisions.price(req, offered, spec.proposal.break_even), free, model, spec.drafter.model_ran_for(req)))
        record(req, offered, accepted, emitted)

    spec.propose, spec.record = traced_propose, traced_record
    got = run(sched, ps, [greedy(24)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert not any(ran["0"]) and any(ran["1"])
    assert prices["0"]  # its n-grams verified drafts, at the verify's own price
    assert all(price == free for price, free, _, _ in prices["0"])
    with_model = [(price, free, model) for price, free, model, ran in prices["1"] if ran]
    assert with_model and all(price == max(free, model) for price, free, model in with_model)
    sched.check_all_free()


def test_a_step_where_nothing_was_drafted_is_timed_as_plain(tiny_llama_dir) -> None:
    """n-grams that find no match leave the step a plain decode: its time goes to the cost
    model as plain decoding's, not as the speculative budget's (it made a verify look as
    cheap as a plain step, and its break-even 1.0)."""
    g = torch.Generator().manual_seed(7)
    ps = [torch.randperm(3000, generator=g)[:40].add(3).tolist()]  # no token repeats
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM",
                           speculative_disable_cost_model=False)
    spec = sched.spec
    propose = spec.propose
    seen = []

    def traced(reqs):
        out = propose(reqs)
        if any(spec.eligible(r) for r in reqs):
            seen.append((any(t is not None for t in out.trees), out.budget))
        return out

    spec.propose = traced
    run(sched, ps, [greedy(12)])
    empty = [b for drafted, b in seen if not drafted]
    assert empty and set(empty) == {1}
    sched.check_all_free()
