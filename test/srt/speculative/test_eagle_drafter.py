"""The EAGLE (EAGLE-1/2) drafter: drafts are the head's own greedy chain over the target's
final hidden state (against a reference run outside the engine), greedy output equals plain
output token for token (float32) for chains and trees, batch 1 and 4, radix hits, chunked
prefill, a MoE target with the expert store; the checkpoint names are upstream's."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.srt.models.llama_eagle import load_eagle_head
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.eagle_fixtures import build_tiny_eagle3_head, build_tiny_eagle_head
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import greedy, make_scheduler, run


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return build_tiny_eagle_head(tiny_llama_dir, str(tmp_path_factory.mktemp("eagle") / "h"))


def prompts(batch: int, seed: int, lo: int = 6, hi: int = 30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 3000, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(batch)]


def _eagle(target, head, **kw):
    return make_scheduler(target, speculative_algorithm="EAGLE",
                          speculative_draft_model_path=head, **kw)


def _reference_chain(target_dir, head_dir, seq, steps):
    """The head's greedy chain after `seq` (prompt + first token), outside the engine: the
    target's final hidden state (last layer, final norm) over seq[:-1], rows reading
    seq[1:], then each draft step feeding back the head's own output."""
    target = TinyRunner(target_dir)
    target.rows, target.lens = [target.req_pool.alloc()], [0]
    last = target.model.config.num_hidden_layers - 1
    target._forward(ForwardMode.EXTEND, [seq[:-1]], False, capture_layers=[last])
    final = target.model.model.norm(target.last_batch.captured_hidden)
    head = load_eagle_head(head_dir)
    head.set_embed_and_head(target.model.model.embed_tokens, target.model.lm_head)
    runner = TinyRunner(None, model=head, config=head.config)
    runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
    logits, out = runner._forward(ForwardMode.EXTEND, [seq[1:]], False, hidden=final)
    chain = []
    for _ in range(steps):
        tok = int(logits[-1:].argmax(-1)[0])
        chain.append(tok)
        logits, out = runner._forward(ForwardMode.DECODE, [[tok]], False, hidden=out[-1:])
    return chain


def test_the_drafts_are_the_heads_chain_over_the_targets_final_hidden(tiny_llama_dir,
                                                                       head_dir):
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=4, speculative_eagle_topk=1)
    prompt = prompts(1, seed=5, lo=12, hi=13)[0]
    sched.add_request(TokenizedGenerateReqInput(
        rid="a", input_ids=prompt, sampling_params=SamplingParams.from_dict(greedy(30))))
    trees = []
    while not sched.is_idle():
        sched.step()
        if sched.spec.proposal.trees and sched.spec.proposal.trees[0] is not None:
            trees.append(sched.spec.proposal.trees[0])
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()
    first = trees[0]
    seq = prompt + [first.tokens[0]]
    assert first.tokens[1:] == _reference_chain(tiny_llama_dir, head_dir, seq, 4)
    assert len(trees) >= 3


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_scheduler(tiny_llama_dir)


@pytest.mark.parametrize("steps,topk,draft_tokens", [(3, 1, None), (3, 2, 6), (2, 4, 8),
                                                     (4, 4, 16)])
@pytest.mark.parametrize("batch", [1, 4])
def test_eagle_is_lossless(tiny_llama_dir, head_dir, plain, steps, topk, draft_tokens, batch):
    ps = prompts(batch, seed=20 + batch)
    ref = run(plain, ps, [greedy(24)] * batch)
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=steps,
                   speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens)
    got = run(sched, ps, [greedy(24)] * batch)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["spec_verify_ct"] > 0 for _, u in got.values())
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()


def test_radix_hits_and_chunked_prefill_stay_lossless(tiny_llama_dir, head_dir, plain):
    doc = prompts(1, seed=31, lo=70, hi=71)[0]
    qs = [doc + q for q in prompts(3, seed=32, lo=3, hi=8)]
    ref = run(plain, qs, [greedy(16)] * 3)
    sched = _eagle(tiny_llama_dir, head_dir, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, chunked_prefill_size=16)
    assert run(sched, qs[:1], [greedy(16)])["0"][0] == ref["0"][0]
    got = run(sched, qs, [greedy(16)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["draft_cached_tokens"] >= 64 for _, u in got.values())
    # a hit leaves the last matched token to the target: the head reads its features
    assert sched.spec.drafter.missing_features == 0
    sched.tree_cache.check_integrity()
    sched.flush_cache()
    sched.check_all_free()


def test_moe_target_with_expert_store_and_prefetch_is_lossless(tiny_moe_dir, moe_prompts,
                                                               tmp_path):
    target = tiny_moe_dir("mixtral")
    head = build_tiny_eagle_head(target, str(tmp_path / "head"))
    kw = dict(moe_expert_cache_slots=2, moe_prefetch_predictor="draft")
    ref = run(make_scheduler(target, **kw), moe_prompts, [greedy(12)] * 2)
    sched = _eagle(target, head, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, **kw)
    got = run(sched, moe_prompts, [greedy(12)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()


def test_upstream_names_load_and_wrong_heads_are_refused(tiny_llama_dir, head_dir, tmp_path):
    from safetensors import safe_open

    with safe_open(f"{head_dir}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    # upstream's EAGLE names: fc with a bias, layer 0 without its input norm
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert "layers.0.input_layernorm.weight" not in names
    head = load_eagle_head(head_dir)
    assert head.model.fc.bias is not None and head.lm_head is None  # the target's head
    with pytest.raises(ValueError, match="EAGLE head"):
        _eagle(tiny_llama_dir, tiny_llama_dir)  # a whole model is not a head
    eagle3 = build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path / "e3"))
    with pytest.raises(ValueError, match="EAGLE head"):
        _eagle(tiny_llama_dir, eagle3)  # an EAGLE-3 head under EAGLE
    with pytest.raises(ValueError, match="full or streaming"):
        _eagle(tiny_llama_dir, head_dir, speculative_draft_kv_policy="retrieval")
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="EAGLE head"):
        ServerArgs(model_path=tiny_llama_dir, speculative_algorithm="EAGLE")
