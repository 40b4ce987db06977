"""NEXTN: DeepSeek-V3's multi-token-prediction layer, read from the target's checkpoint, as
a draft head. Its logits equal the MTP forward composed from transformers' DeepSeek-V3
decoder layer; the drafts are its own greedy chain over the target's final hidden state;
greedy output equals plain output token for token (float32) for chains and trees, batch 1
and 4, radix hits, chunked prefill, the target's experts offloaded with prefetch; EAGLE
and HYBRID take the same checkpoint; checkpoints without the layer are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.srt.model_loader.loader import load_model
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.eagle_fixtures import build_tiny_deepseek_mtp
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import greedy, make_scheduler, run

LAYERS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return build_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("nextn") / "ds"), layers=LAYERS)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make_scheduler(target_dir)


def prompts(batch: int, seed: int, lo: int = 6, hi: int = 30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 3000, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(batch)]


def _nextn(target, **kw):
    return make_scheduler(target, speculative_algorithm="NEXTN", **kw)


def _target_final_hidden(target_dir, seq):
    """The target's final hidden state (after its final norm) over `seq`, our engine."""
    target = TinyRunner(target_dir)
    target.rows, target.lens = [target.req_pool.alloc()], [0]
    target._forward(ForwardMode.EXTEND, [seq], False, capture_layers=[LAYERS - 1])
    return target, target.model.model.norm(target.last_batch.captured_hidden)


def _head_runner(target_dir, target):
    head, config = load_model(target_dir, architecture="DeepseekV3ForCausalLMNextN")
    head.set_embed_and_head(target.model.model.embed_tokens, target.model.lm_head)
    runner = TinyRunner(None, model=head, config=config)
    runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
    return runner


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_the_mtp_layer_matches_transformers_decoder_layer(target_dir):
    """Rows as upstream's: row i reads token i + 1 beside the target's final hidden at i."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    seq = prompts(1, seed=3, lo=11, hi=12)[0]
    target, final = _target_final_hidden(target_dir, seq[:-1])
    runner = _head_runner(target_dir, target)
    logits, out = runner._forward(ForwardMode.EXTEND, [seq[1:]], True, hidden=final)

    hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                              num_hidden_layers=LAYERS + 1,
                                              attn_implementation="eager").eval()
    w = load_file(os.path.join(target_dir, "model.safetensors"))
    p, eps = f"model.layers.{LAYERS}.", hf.config.rms_norm_eps
    with torch.no_grad():
        ids = torch.tensor([seq])
        h_final = hf_target.model(ids[:, :-1]).last_hidden_state[0]  # post final norm
        assert torch.allclose(h_final, final, atol=1e-4)
        e = hf.model.embed_tokens(ids[:, 1:])[0]
        x = torch.cat([_rms(e, w[p + "enorm.weight"], eps),
                       _rms(h_final, w[p + "hnorm.weight"], eps)], -1) @ w[p + "eh_proj.weight"].T
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = hf.model.layers[LAYERS](x[None], attention_mask=mask, position_ids=pos,
                                    position_embeddings=hf.model.rotary_emb(x[None], pos))
        y = y[0] if isinstance(y, tuple) else y
        ref_out = _rms(y[0], w[p + "shared_head.norm.weight"], eps)
        ref_logits = ref_out @ w[p + "shared_head.head.weight"].T
    assert torch.allclose(out, ref_out, atol=1e-4), (out - ref_out).abs().max()
    assert torch.allclose(logits, ref_logits, atol=1e-3), (logits - ref_logits).abs().max()


def _reference_chain(target_dir, seq, steps):
    """The MTP layer's greedy chain after `seq` (prompt + first token), outside the engine."""
    target, final = _target_final_hidden(target_dir, seq[:-1])
    runner = _head_runner(target_dir, target)
    logits, out = runner._forward(ForwardMode.EXTEND, [seq[1:]], False, hidden=final)
    chain = []
    for _ in range(steps):
        tok = int(logits[-1:].argmax(-1)[0])
        chain.append(tok)
        logits, out = runner._forward(ForwardMode.DECODE, [[tok]], False, hidden=out[-1:])
    return chain


def test_the_drafts_are_the_mtp_layers_chain(target_dir):
    sched = _nextn(target_dir, speculative_num_steps=4, speculative_eagle_topk=1)
    assert sched.spec.drafter.runner.num_layers == 1  # one MLA layer of draft KV
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
    assert first.tokens[1:] == _reference_chain(target_dir, seq, 4)
    assert len(trees) >= 3


@pytest.mark.parametrize("steps,topk,draft_tokens", [(None, None, None), (3, 2, 6), (2, 4, 8)])
@pytest.mark.parametrize("batch", [1, 4])
def test_nextn_is_lossless(target_dir, plain, steps, topk, draft_tokens, batch):
    ps = prompts(batch, seed=20 + batch)
    ref = run(plain, ps, [greedy(24)] * batch)
    sched = _nextn(target_dir, speculative_num_steps=steps, speculative_eagle_topk=topk,
                   speculative_num_draft_tokens=draft_tokens)
    if steps is None:  # upstream's DeepSeek defaults: 3 steps, topk 1, 4 draft tokens
        assert (sched.spec.cfg.num_steps, sched.spec.cfg.topk,
                sched.spec.cfg.num_draft_tokens) == (3, 1, 4)
    got = run(sched, ps, [greedy(24)] * batch)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["spec_verify_ct"] > 0 for _, u in got.values())
    assert sched.spec.drafter.missing_features == 0
    sched.check_all_free()


def test_radix_hits_and_chunked_prefill_stay_lossless(target_dir, plain):
    doc = prompts(1, seed=31, lo=70, hi=71)[0]
    qs = [doc + q for q in prompts(3, seed=32, lo=3, hi=8)]
    ref = run(plain, qs, [greedy(16)] * 3)
    sched = _nextn(target_dir, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, chunked_prefill_size=16)
    assert run(sched, qs[:1], [greedy(16)])["0"][0] == ref["0"][0]
    got = run(sched, qs, [greedy(16)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["draft_cached_tokens"] >= 64 for _, u in got.values())
    assert sched.spec.drafter.missing_features == 0
    sched.tree_cache.check_integrity()
    sched.flush_cache()
    sched.check_all_free()


def test_offloaded_target_experts_with_prefetch_stay_lossless(target_dir):
    """The target's experts served from the checkpoint (2 of 8 resident per layer), the
    MTP layer's own experts resident; its drafts feed the expert prefetch."""
    ps = prompts(2, seed=41)
    kw = dict(moe_expert_cache_slots=2, moe_prefetch_predictor="draft")
    ref = run(make_scheduler(target_dir, **kw), ps, [greedy(12)] * 2)
    sched = _nextn(target_dir, speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=5, **kw)
    assert sched.spec.drafter.runner.expert_store is None
    got = run(sched, ps, [greedy(12)] * 2)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert sched.runner.expert_store.stats().total().prefetch_loads > 0
    sched.check_all_free()


def test_eagle_and_hybrid_take_the_mtp_layer(target_dir, plain):
    from sglang.srt.speculative.drafters.nextn import NextNDrafter

    ps = prompts(2, seed=51)
    ref = run(plain, ps, [greedy(16)] * 2)
    eagle = make_scheduler(target_dir, speculative_algorithm="EAGLE",
                           speculative_draft_model_path=target_dir)
    hybrid = make_scheduler(target_dir, speculative_algorithm="HYBRID",
                            speculative_draft_model_path=target_dir)
    assert isinstance(eagle.spec.drafter, NextNDrafter)
    assert isinstance(hybrid.spec.drafter.model, NextNDrafter)
    for sched in (eagle, hybrid):
        got = run(sched, ps, [greedy(16)] * 2)
        for rid, (ids, _) in ref.items():
            assert got[rid][0] == ids
        sched.check_all_free()


def test_a_one_layer_export_drafts_alike(target_dir, tmp_path):
    """Upstream's export keeps the MTP layer alone as layer 0 (num_hidden_layers 1)."""
    from safetensors.torch import load_file, save_file

    w = load_file(os.path.join(target_dir, "model.safetensors"))
    p = f"model.layers.{LAYERS}."
    out = tmp_path / "mtp"
    out.mkdir()
    save_file({"model.layers.0." + k[len(p):]: v for k, v in w.items() if k.startswith(p)},
              str(out / "model.safetensors"))
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    (out / "config.json").write_text(json.dumps(config))
    ps = prompts(2, seed=61)
    a = _nextn(target_dir, speculative_num_steps=3)
    b = _nextn(target_dir, speculative_num_steps=3, speculative_draft_model_path=str(out))
    ga, gb = run(a, ps, [greedy(16)] * 2), run(b, ps, [greedy(16)] * 2)
    for rid in ga:
        assert ga[rid][0] == gb[rid][0]
        assert (ga[rid][1].extra_meta["spec_verify_ct"]
                == gb[rid][1].extra_meta["spec_verify_ct"])  # the same drafts accepted


def test_targets_without_an_mtp_layer_are_refused(tiny_llama_dir, tiny_moe_dir, tmp_path):
    from sglang.srt.server_args import ServerArgs

    assert (ServerArgs(model_path=tiny_llama_dir, speculative_algorithm="NEXTN")
            .speculative_draft_model_path == tiny_llama_dir)  # upstream's default
    with pytest.raises(ValueError, match="multi-token-prediction"):
        _nextn(tiny_llama_dir)  # a Llama has none
    # a DeepSeek-V3 config that promises the layer, a checkpoint without its tensors
    with pytest.raises(ValueError, match="no complete multi-token-prediction layer"):
        _nextn(tiny_moe_dir("deepseek_v3"))
    source, stripped = tiny_moe_dir("deepseek_v3"), tmp_path / "v3"
    stripped.mkdir()
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), stripped / name)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 0
    (stripped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        _nextn(str(stripped))
    with pytest.raises(ValueError, match="full or streaming"):
        ServerArgs(model_path=tiny_llama_dir, speculative_algorithm="NEXTN",
                   speculative_draft_kv_policy="retrieval")
