"""Long-context drafting: draft context policies, positions in range, bounded draft memory,
draft and target KV in one radix tree, warming a document (speculative/draft_kv.py)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.test.scheduler_driver import greedy, make_scheduler, run

STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3)


def document(n: int, seed: int) -> List[int]:
    """A synthetic document: quotes of one passage between fresh tokens (long documents
    quote themselves), `n` tokens long."""
    g = torch.Generator().manual_seed(seed)
    passage = torch.randint(3, 3000, (64,), generator=g).tolist()
    out: List[int] = []
    while len(out) < n:
        out += passage[: int(torch.randint(8, 64, (1,), generator=g))]
        out += torch.randint(3, 3000, (8,), generator=g).tolist()
    return out[:n]


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> str:
    """1-layer tiny llama with a position range large enough for 64K-token documents;
    used as target and as its own draft (a full view accepts everything)."""
    from sglang.test.fixtures import build_tiny_model

    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny") / "long"), seed=0,
                            num_hidden_layers=1, max_position_embeddings=131072)


@pytest.fixture(scope="module")
def plain(tiny_long):
    return make_scheduler(tiny_long)


@pytest.fixture(scope="module")
def batch_reference(plain):
    prompts = [document(300, 1), document(500, 2), document(420, 3)]
    return prompts, run(plain, prompts, [greedy(20)] * 3)


class Probe:
    """Wraps a runner's forward: counts tokens per kind and records draft positions,
    view lengths and the draft pool's peak usage (minus what the radix cache holds)."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.target: Dict[str, int] = {}
        self.draft_catch_up = 0
        self.max_position = -1
        self.max_view = 0
        self.peak_owned = 0
        target_fwd = sched.runner.forward
        drafter = sched.spec.drafter
        draft_fwd = drafter.runner.forward

        def on_target(fb):
            mode = fb.forward_mode.name
            self.target[mode] = self.target.get(mode, 0) + fb.num_tokens
            return target_fwd(fb)

        def on_draft(fb):
            if fb.custom_mask is None:  # catch-up pieces and chunk recomputes, not the tree
                self.draft_catch_up += fb.num_tokens
            self.max_position = max(self.max_position, int(fb.positions.max()))
            self.max_view = max(self.max_view, max(len(k) for k in fb.kv_indices))
            alloc = drafter.allocator
            used = alloc.size - alloc.available_size() - sched.tree_cache.draft_total_size()
            self.peak_owned = max(self.peak_owned, used)
            return draft_fwd(fb)

        sched.runner.forward = on_target
        drafter.runner.forward = on_draft

    def reset(self) -> None:
        self.target, self.draft_catch_up = {}, 0


# (policy kwargs, batch, extra scheduler kwargs): budgets from far below the prompt
# (8 tokens for 300-500-token prompts) to above it; small position ranges force rebases.
CONFIGS = [
    ({}, {}),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=8), {}),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=24,
          speculative_draft_max_position=64), {}),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=1024), {}),
    (dict(speculative_draft_kv_policy="retrieval", speculative_draft_kv_budget=28,
          speculative_draft_kv_chunk_size=8), {}),
    (dict(speculative_draft_kv_policy="retrieval", speculative_draft_kv_budget=48,
          speculative_draft_kv_chunk_size=4, speculative_draft_kv_refresh_interval=1,
          speculative_draft_max_position=128, speculative_eagle_topk=2,
          speculative_num_draft_tokens=6), {}),
    (dict(speculative_draft_kv_policy="retrieval", speculative_draft_kv_budget=64,
          speculative_draft_kv_chunk_size=8), dict(chunked_prefill_size=128)),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=32),
     dict(disable_radix_cache=True)),
]


@pytest.mark.parametrize("policy,extra", CONFIGS)
def test_lossless_every_policy_and_budget(tiny_long, batch_reference, policy, extra):
    prompts, ref = batch_reference
    sched = make_scheduler(tiny_long, speculative_draft_model_path=tiny_long,
                           **STANDALONE, **policy, **extra)
    probe = Probe(sched)
    got = run(sched, prompts, [greedy(20)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    cfg = sched.spec.drafter.kv.cfg
    tree = sched.spec.drafter.tree_slots
    if cfg.bounded:
        # Every position the draft saw is one it was trained on; every view is bounded.
        assert probe.max_position < cfg.max_position
        assert probe.max_view <= cfg.budget + tree
        assert probe.peak_owned <= 3 * (cfg.budget + tree)
    else:  # a full view: the same draft as the target accepts (nearly) every token
        assert all(u.extra_meta["spec_accept_length"] > 3 for _, u in got.values())
    sched.check_all_free()


@pytest.mark.parametrize("policy", [{}, dict(speculative_draft_kv_policy="streaming",
                                               speculative_draft_kv_budget=16)])
def test_retraction_hands_draft_kv_to_the_cache(tiny_long, plain, policy):
    """A target pool that fits the prompts but not their growth: the newest request is
    retracted (its draft prefix goes to the tree with its target KV), resumes from the
    tree (adopting the draft prefix), and output is unchanged."""
    prompts = [document(200, 1), document(200, 2)]
    ref = run(plain, prompts, [greedy(40)] * 2)
    sched = make_scheduler(tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE,
                           max_total_tokens=440, chunked_prefill_size=128, **policy)
    got = run(sched, prompts, [greedy(40)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert sum(u.total_retractions for _, u in got.values()) > 0
    sched.check_all_free()


@dataclasses.dataclass
class FakeReq:
    """What the drafter reads of a request."""

    rid: str
    fill_ids: List[int]
    req_pool_idx: int = 0

    @property
    def fill_len(self) -> int:
        return len(self.fill_ids)


@pytest.mark.parametrize("policy", ["streaming", "retrieval"])
def test_draft_memory_flat_from_1k_to_64k(tiny_long, policy):
    """One request whose context grows from 1K to 64K tokens: the draft pool never holds
    more than budget + tree, views stay bounded, positions stay in range (rebases)."""
    from sglang.srt.speculative.drafters.standalone import StandaloneDrafter

    args = ServerArgs(model_path=tiny_long, dtype="float32", speculative_draft_model_path=tiny_long,
                      speculative_draft_kv_policy=policy, speculative_draft_kv_budget=1024,
                      speculative_draft_kv_chunk_size=64, speculative_draft_max_position=4096,
                      **STANDALONE)
    drafter = StandaloneDrafter(args, 1, 66000, 4096, num_steps=3, topk=1, chunk_size=1024)
    alloc, fwd = drafter.allocator, drafter.runner.forward
    seen = {"peak": 0, "pos": 0, "view": 0}

    def probe(fb):
        seen["pos"] = max(seen["pos"], int(fb.positions.max()))
        seen["view"] = max(seen["view"], max(len(k) for k in fb.kv_indices))
        out = fwd(fb)
        seen["peak"] = max(seen["peak"], alloc.size - alloc.available_size())
        return out

    drafter.runner.forward = probe
    doc = document(65536, 5)
    req = FakeReq("a", [])
    bound = 1024 + drafter.tree_slots
    peaks = []
    for length in (1024, 4096, 16384, 65536):
        seen["peak"] = 0
        req.fill_ids = doc[:length]
        for _ in range(3):  # a few decode steps at this length
            tree = drafter.propose([req], [4])[0]
            req.fill_ids = req.fill_ids + [tree.tokens[1], 7]
        peaks.append(seen["peak"])
        assert drafter.resident(req) <= 1024
    assert max(peaks) <= bound  # the same bound at 1K and at 64K: flat in context length
    assert seen["view"] <= bound and seen["pos"] < 4096
    if policy == "retrieval":  # every chunk of the document was summarized on the way
        assert drafter.contexts["a"].num_summaries == len(req.fill_ids) // 64
    sinks = drafter.release_kv(req, keep=len(req.fill_ids))
    assert len(sinks) == 4  # only the sinks are a prefix the radix cache could take
    drafter.allocator.free(sinks)  # (here: no cache; the caller owns them now)
    drafter.check_all_free()


def _warm_then_ask(sched, probe, doc, question, n=16):
    probe.reset()
    warm = run(sched, [doc], [{"max_new_tokens": 0}])["0"][1]
    sched.tree_cache.check_integrity()
    warm_probe = (dict(probe.target), probe.draft_catch_up)
    probe.reset()
    ask = run(sched, [doc + question], [greedy(n)])["0"]
    sched.tree_cache.check_integrity()
    return warm, warm_probe, ask


def test_shared_document_full_policy(tiny_long, plain):
    """A warmed document is cached for both models: the question's prefill computes only
    its own tokens, in the target and in the draft."""
    doc, question = document(600, 7), document(20, 8)
    ref = run(plain, [doc + question], [greedy(16)])["0"][0]
    # Chunked prefill of the question: its progress is cached with the adopted draft slots.
    sched = make_scheduler(tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE,
                           chunked_prefill_size=16)
    probe = Probe(sched)
    handed = []
    on_cached = sched.spec.on_cached
    sched.spec.on_cached = lambda req, idx, n: (handed.append(n), on_cached(req, idx, n))
    warm, (warm_target, warm_draft), (ids, upd) = _warm_then_ask(sched, probe, doc, question)
    assert warm.extra_meta["draft_cached_tokens"] == 0 and warm.cached_tokens == 0
    assert warm_target == {"EXTEND": 600} and warm_draft == 600
    assert ids == ref
    assert upd.cached_tokens == 600 and upd.extra_meta["draft_cached_tokens"] == 600
    assert probe.target["EXTEND"] == 20  # the question only
    # The draft reads the question and the tokens emitted after it, nothing of the document.
    assert 21 <= probe.draft_catch_up <= 20 + 16
    assert handed == [600]  # after the question's first chunk: the document's draft prefix
    sched.check_all_free()


@pytest.mark.parametrize("policy", ["streaming", "retrieval"])
def test_shared_document_bounded_policy(tiny_long, plain, policy):
    """Bounded policies cache the sinks in the tree (the rest of their view is not a
    prefix); a question on a warmed document re-reads at most its window, whatever the
    document's length (retrieval reuses the chunk summaries of the warm-up)."""
    doc, question = document(1500, 9), document(20, 10)
    ref = run(plain, [doc + question], [greedy(16)])["0"][0]
    sched = make_scheduler(tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE,
                           speculative_draft_kv_policy=policy, speculative_draft_kv_budget=64,
                           speculative_draft_kv_chunk_size=8)
    probe = Probe(sched)
    warm, _, (ids, upd) = _warm_then_ask(sched, probe, doc, question)
    assert ids == ref
    assert upd.cached_tokens == 1500 and upd.extra_meta["draft_cached_tokens"] == 4  # sinks
    assert probe.target["EXTEND"] == 20
    # Window + question + output, plus retrieved chunks re-entering the view (recomputed
    # at most once per step): bounded by the budget, not by the document's 1500 tokens.
    retrieved = sched.spec.drafter.kv.cfg.retrieved
    assert probe.draft_catch_up <= 64 + 20 + 16 + upd.extra_meta["spec_verify_ct"] * retrieved
    assert probe.draft_catch_up < 1500 // 4
    sched.check_all_free()


def test_draft_evicted_before_target(tiny_long, plain):
    """A draft pool too small for two warmed documents drops the older one's draft KV and
    keeps its target KV; a question on it then reuses the target prefix only."""
    doc_a, doc_b, question = document(500, 11), document(500, 12), document(12, 13)
    ref = run(plain, [doc_a + question], [greedy(12)])["0"][0]
    sched = make_scheduler(tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE,
                           speculative_draft_max_total_tokens=700)
    cache = sched.tree_cache
    run(sched, [doc_a], [{"max_new_tokens": 0}])
    assert cache.draft_total_size() == 500 and cache.total_size() == 500
    run(sched, [doc_b], [{"max_new_tokens": 0}])
    cache.check_integrity()
    assert cache.total_size() == 1000  # both documents' target KV stayed
    assert cache.draft_total_size() == 500  # only B's draft KV: A's went first
    assert cache.match_prefix(doc_b).draft_length == 500
    assert cache.match_prefix(doc_a).draft_length == 0
    ids, upd = run(sched, [doc_a + question], [greedy(12)])["0"]
    assert ids == ref
    assert upd.cached_tokens == 500 and upd.extra_meta["draft_cached_tokens"] == 0
    cache.check_integrity()
    sched.check_all_free()


@pytest.mark.parametrize("kw,message", [
    (dict(speculative_draft_kv_policy="sliding"), "must be one of full"),
    (dict(speculative_draft_kv_budget=64), "bounds the streaming"),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=6), "no recent"),
    (dict(speculative_draft_kv_policy="retrieval", speculative_draft_kv_budget=100,
          speculative_draft_kv_chunk_size=64), "too small for retrieval"),
    (dict(speculative_draft_kv_policy="streaming", speculative_draft_kv_refresh_interval=0),
     "at least 1"),
])
def test_flag_validation(tiny_long, kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE, **kw)


def test_position_range_checked_at_load(tiny_long):
    with pytest.raises(ValueError, match="half the draft's position range"):
        make_scheduler(tiny_long, speculative_draft_model_path=tiny_long, **STANDALONE,
                       speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=64,
                       speculative_draft_max_position=100)


def test_retrieval_picks_chunks_matching_the_query():
    """Chunks are scored by query . mean key; the chosen ones enter the view at their true
    positions before any rebase, and packed after the sinks (document order) after one."""
    from sglang.srt.mem_cache.memory_pool import KVPool, TokenSlotAllocator
    from sglang.srt.speculative.draft_kv import DraftKV, DraftKVConfig
    from sglang.srt.speculative.draft_kv_state import DraftContext

    cfg = DraftKVConfig("retrieval", budget=28, sink=4, chunk_size=4, refresh_interval=4,
                        max_position=1024, tree_depth=3, piece=6)
    assert cfg.num_chunks == 3 and cfg.window == 12  # half of what the sinks leave: chunks
    alloc = TokenSlotAllocator(256)
    kv = DraftKV(cfg, alloc, KVPool(256, 1, 1, 4, torch.float32), 1, summary_capacity=64)
    ctx = DraftContext(torch.zeros(512, dtype=torch.int64))
    ctx.split, ctx.prefix_len, ctx.computed, ctx.window_start = True, 4, 200, 160
    ctx.row[:4] = alloc.alloc(4)
    keys = torch.zeros(40, 1, 1, 4)
    for j, axis, w in ((7, 0, 1.0), (12, 0, 2.0), (30, 0, 3.0), (20, 1, 1.0), (25, 1, 0.5)):
        keys[j, 0, 0, axis] = w  # chunks 7, 12, 30 point along the query; 20 and 25 elsewhere
    for j in range(40):
        kv._add_summary(ctx, keys[j])
    ctx.query = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])  # [layers, kv_heads, head_dim]
    tokens = list(range(200))
    jobs = kv.select_chunks(ctx, tokens)
    assert [j.chunk for j in jobs] == [7, 12, 30]
    assert [int(j.positions[0]) for j in jobs] == [28, 48, 120]  # true positions
    assert jobs[0].tokens == tokens[28:32]
    assert len(kv.view(ctx)) == 4 + 12
    # The query turns toward chunks 20 and 25: each refresh swaps in one newcomer (a chunk
    # costs a draft forward) in place of the lowest-scored chunk that left the top set.
    ctx.query = torch.tensor([[[1.0, 10.0, 0.0, 0.0]]])
    jobs = kv.select_chunks(ctx, tokens)
    assert [j.chunk for j in jobs] == [20] and int(jobs[0].positions[0]) == 80
    assert sorted(ctx.chunks) == [12, 20, 30]
    jobs = kv.select_chunks(ctx, tokens)
    assert [j.chunk for j in jobs] == [25] and sorted(ctx.chunks) == [20, 25, 30]
    assert kv.select_chunks(ctx, tokens) == []  # a settled view costs nothing
    assert len(kv.view(ctx)) == 4 + 12
    ctx.base = 100  # after a rebase: chunks packed right after the sinks, document order
    jobs = kv.select_chunks(ctx, tokens)
    assert [j.chunk for j in jobs] == [20, 25, 30]
    assert [int(j.positions[0]) for j in jobs] == [4, 8, 12]
    kv.release(ctx, keep=4)
    alloc.free(ctx.row[:4].clone())
    assert alloc.available_size() == alloc.size


def test_retrieval_follows_the_text_being_copied():
    """When the latest tokens repeat a passage of the document, the chunk holding what
    followed them enters the view at the next step (not at the next scheduled refresh),
    whatever the key scores say."""
    from sglang.srt.mem_cache.memory_pool import KVPool, TokenSlotAllocator
    from sglang.srt.speculative.draft_kv import DraftKV, DraftKVConfig
    from sglang.srt.speculative.draft_kv_state import DraftContext

    cfg = DraftKVConfig("retrieval", budget=28, sink=4, chunk_size=4, refresh_interval=4,
                        max_position=1024, tree_depth=3, piece=6)
    alloc = TokenSlotAllocator(256)
    kv = DraftKV(cfg, alloc, KVPool(256, 1, 1, 4, torch.float32), 1, summary_capacity=64)
    ctx = DraftContext(torch.zeros(512, dtype=torch.int64))
    ctx.split, ctx.prefix_len, ctx.computed, ctx.window_start = True, 4, 200, 160
    ctx.row[:4] = alloc.alloc(4)
    for _ in range(40):
        kv._add_summary(ctx, torch.zeros(1, 1, 4))
    ctx.query = torch.zeros(1, 1, 4)  # key scores say nothing
    ctx.need_refresh, ctx.steps_since_refresh = False, 0
    tokens = list(range(1000, 1200))
    assert not kv.refresh_due(ctx, tokens)  # nothing is being copied
    tokens[192:200] = tokens[33:41]  # the text now quotes tokens 33..40; 41 comes next
    assert kv.refresh_due(ctx, tokens)
    jobs = {j.chunk: j for j in kv.select_chunks(ctx, tokens)}
    assert 10 in jobs and int(jobs[10].positions[0]) == 40  # chunk 10 holds token 41
    assert not kv.refresh_due(ctx, tokens)
    kv.release(ctx, keep=4)
    alloc.free(ctx.row[:4].clone())
    assert alloc.available_size() == alloc.size
