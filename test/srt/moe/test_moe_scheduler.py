"""MoE models through the real Scheduler + ModelRunner (latent KV pool for MLA, expert store
from --moe-expert-cache-slots): plain greedy equals the reference runner, and speculative
greedy (n-gram trees, verified with tree masks over the latent pool) equals plain."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.mla_pool import MLATokenToKVPool, create_kv_pool
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import greedy, make_scheduler, run


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 3000, (n,), generator=g).tolist() * 3 for n in (5, 9)]


def _reference(folder, prompts, n):
    runner = TinyRunner(folder, dtype="float32", kv_slots=2048)
    runner.kv_pool = create_kv_pool(runner.config, 2048, runner.dtype)
    return runner.generate_greedy(prompts, n)


def test_deepseek_scheduler_plain_store_and_ngram(tiny_moe_dir) -> None:
    folder = tiny_moe_dir("deepseek_v3")
    prompts, n = _prompts(), 12
    ref = _reference(folder, prompts, n)

    plain = make_scheduler(folder)
    assert isinstance(plain.runner.kv_pool, MLATokenToKVPool)
    got = run(plain, prompts, [greedy(n)] * len(prompts))
    assert [got[str(i)][0] for i in range(len(prompts))] == ref
    plain.check_all_free()

    stored = make_scheduler(folder, moe_expert_cache_slots=3)
    store = stored.runner.model.expert_store
    got = run(stored, prompts, [greedy(n)] * len(prompts))
    assert [got[str(i)][0] for i in range(len(prompts))] == ref
    stored.check_all_free()
    store.check_idle()
    assert store.stats().total().misses > 0
    store.close()

    spec = make_scheduler(folder, speculative_algorithm="NGRAM", speculative_num_steps=3,
                          speculative_num_draft_tokens=6)
    got = run(spec, prompts, [greedy(n)] * len(prompts))
    assert [got[str(i)][0] for i in range(len(prompts))] == ref
    assert sum(u.extra_meta["spec_verify_ct"] for _, u in got.values()) > 0
    spec.check_all_free()


def test_mla_standalone_self_draft_trees_are_lossless(tiny_moe_dir) -> None:
    """Draft = target (DeepSeek-V2, MLA on both sides): top-2 trees verified over the latent
    pool accept more than one token per step and change nothing."""
    folder = tiny_moe_dir("deepseek_v2")
    prompts, n = _prompts(), 12
    ref = _reference(folder, prompts, n)
    spec = make_scheduler(folder, speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=folder, speculative_num_steps=3,
                          speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    got = run(spec, prompts, [greedy(n)] * len(prompts))
    assert [got[str(i)][0] for i in range(len(prompts))] == ref
    assert all(u.extra_meta["spec_accept_length"] > 1.5 for _, u in got.values())
    spec.check_all_free()
