"""The EAGLE3 drafter in the scheduler: its drafts are the head's own greedy chain over the
target's features (against a reference run of head and target outside the engine), and
greedy output equals plain output token for token (float32) for chains and trees, batch 1
and 4, radix hits, chunked prefill and the streaming draft view."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.srt.models.llama_eagle3 import load_eagle3_head
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.eagle_fixtures import build_tiny_eagle3_head
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import greedy, make_scheduler, run

LAYERS = (0, 1, 2)  # the tiny target has three layers


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path_factory.mktemp("eagle3") / "h"))


@pytest.fixture(scope="module")
def small_vocab_head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """A reduced draft vocabulary (every 7th id): draft ids map through d2t."""
    return build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path_factory.mktemp("eagle3") / "s"),
                                  seed=3, draft_ids=range(3, 49152, 7))


def prompts(batch: int, seed: int, lo: int = 6, hi: int = 30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 3000, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(batch)]


def _eagle(target, head, **kw):
    return make_scheduler(target, speculative_algorithm="EAGLE3",
                          speculative_draft_model_path=head, **kw)


def _reference_chain(target_dir, head_dir, seq, steps):
    """The head's greedy chain after `seq` (prompt + first token), computed outside the
    engine: the target's three layers over seq[:-1], rows reading seq[1:], then each
    draft step feeding back the head's own output."""
    target = TinyRunner(target_dir)
    target.rows, target.lens = [target.req_pool.alloc()], [0]
    target._forward(ForwardMode.EXTEND, [seq[:-1]], False, capture_layers=list(LAYERS))
    aux = target.last_batch.captured_hidden
    head = load_eagle3_head(head_dir)
    head.set_embed(target.model.model.embed_tokens)
    runner = TinyRunner(None, model=head, config=head.config)
    runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
    logits, out = runner._forward(ForwardMode.EXTEND, [seq[1:]], False, hidden=aux)
    chain = []
    for _ in range(steps):
        tok = int(head.to_target_ids(logits[-1:].argmax(-1))[0])
        chain.append(tok)
        logits, step_out = runner._forward(ForwardMode.DECODE, [[tok]], False,
                                           hidden=out[-1:], from_target=False)
        out = step_out
    return chain


@pytest.mark.parametrize("which", ["head_dir", "small_vocab_head_dir"])
def test_the_drafts_are_the_heads_chain_over_the_targets_features(tiny_llama_dir, which,
                                                                    request):
    head = request.getfixturevalue(which)
    sched = _eagle(tiny_llama_dir, head, speculative_num_steps=4, speculative_eagle_topk=1)
    prompt = prompts(1, seed=5, lo=12, hi=13)[0]
    sched.add_request(TokenizedGenerateReqInput(
        rid="a", input_ids=prompt, sampling_params=SamplingParams.from_dict(greedy(30))))
    trees = []
    while not sched.is_idle():
        sched.step()
        tree = sched.spec.proposal.trees[0] if sched.spec.proposal.trees else None
        if tree is not None:
            trees.append(tree)
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()
    # the first proposal: after the prompt and the first sampled token (the tree's root)
    first = trees[0]
    seq = prompt + [first.tokens[0]]
    assert first.tokens[1:] == _reference_chain(tiny_llama_dir, head, seq, 4)
    assert len(trees) >= 3


def test_a_later_drafts_features_come_from_verified_tokens(tiny_llama_dir, head_dir):
    """After several verifies, the proposal equals the reference over the whole text."""
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=3, speculative_eagle_topk=1)
    prompt = prompts(1, seed=9, lo=10, hi=11)[0]
    sched.add_request(TokenizedGenerateReqInput(
        rid="a", input_ids=prompt, sampling_params=SamplingParams.from_dict(greedy(40))))
    checked = 0
    while not sched.is_idle():
        before = list(sched.running[0].fill_ids) if sched.running else None
        sched.step()
        tree = sched.spec.proposal.trees[0] if sched.spec.proposal.trees else None
        if tree is not None and before is not None and len(before) > len(prompt) + 8 \
                and checked < 2:
            assert tree.tokens[0] == before[-1]
            assert tree.tokens[1:] == _reference_chain(tiny_llama_dir, head_dir, before, 3)
            checked += 1
    assert checked == 2
    sched.check_all_free()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_scheduler(tiny_llama_dir)


@pytest.mark.parametrize("steps,topk,draft_tokens", [(3, 1, None), (5, 1, None), (3, 2, 6),
                                                     (2, 4, 8), (4, 4, 16)])
@pytest.mark.parametrize("batch", [1, 4])
def test_eagle3_is_lossless(tiny_llama_dir, small_vocab_head_dir, plain, steps, topk,
                            draft_tokens, batch):
    ps = prompts(batch, seed=20 + batch)
    ref = run(plain, ps, [greedy(24)] * batch)
    sched = _eagle(tiny_llama_dir, small_vocab_head_dir, speculative_num_steps=steps,
                   speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens)
    got = run(sched, ps, [greedy(24)] * batch)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["spec_verify_ct"] > 0 for _, u in got.values())
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()


def test_radix_hits_and_chunked_prefill_stay_lossless(tiny_llama_dir, head_dir, plain):
    """Questions on one document: the second wave reuses target and head KV from the radix
    tree; prompts prefill in chunks of 16."""
    doc = prompts(1, seed=31, lo=70, hi=71)[0]
    qs = [doc + q for q in prompts(3, seed=32, lo=3, hi=8)]
    plain.flush_cache()
    run(plain, qs[:1], [greedy(16)])
    ref = run(plain, qs, [greedy(16)] * 3)
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, chunked_prefill_size=16)
    first = run(sched, qs[:1], [greedy(16)])
    assert first["0"][0] == ref["0"][0]
    got = run(sched, qs, [greedy(16)] * 3)
    for rid, (ids, upd) in ref.items():
        assert got[rid][0] == ids
        # the target's hit is plain's: its prefill recomputes the same tokens (bf16 alike)
        assert got[rid][1].cached_tokens == upd.cached_tokens >= 64
    assert all(u.extra_meta["draft_cached_tokens"] >= 64 for _, u in got.values())
    # the head's row at each hit's last token reads zeros; every other row its features
    assert sched.spec.drafter.boundary_rows == 3
    assert sched.spec.drafter.missing_features == 0
    sched.tree_cache.check_integrity()
    sched.flush_cache()
    sched.check_all_free()


def test_streaming_view_is_lossless(tiny_llama_dir, head_dir, plain):
    ps = prompts(2, seed=41, lo=80, hi=120)
    ref = run(plain, ps, [greedy(20)] * 2)
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=3, speculative_eagle_topk=1,
                   speculative_draft_kv_policy="streaming", speculative_draft_kv_budget=48)
    got = run(sched, ps, [greedy(20)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    sched.check_all_free()


def test_bad_heads_and_views_are_refused(tiny_llama_dir, head_dir):
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        _eagle(tiny_llama_dir, tiny_llama_dir)  # a whole model is not a head
    with pytest.raises(ValueError, match="full or streaming"):
        _eagle(tiny_llama_dir, head_dir, speculative_draft_kv_policy="retrieval")
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="EAGLE-3 head"):
        ServerArgs(model_path=tiny_llama_dir, speculative_algorithm="EAGLE3")


@pytest.mark.parametrize("prefetch", [False, True])
def test_moe_target_with_expert_store_is_lossless(tiny_moe_dir, moe_prompts, tmp_path, prefetch):
    """A Mixtral target with 2 of its experts resident per layer: the head reads the MoE
    model's captured layers; its drafts feed the expert prefetch."""
    target = tiny_moe_dir("mixtral")
    head = build_tiny_eagle3_head(target, str(tmp_path / "head"))
    kw = dict(moe_expert_cache_slots=2)
    if prefetch:
        kw["moe_prefetch_predictor"] = "draft"
    ref = run(make_scheduler(target, **kw), moe_prompts, [greedy(12)] * 2)
    sched = _eagle(target, head, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, **kw)
    got = run(sched, moe_prompts, [greedy(12)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()
