"""HYBRID with an EAGLE or EAGLE-3 head as its model side: n-gram and head candidates in
one tree, greedy output equal to plain output token for token (float32), batch 1 and 4,
radix hits; the head reads the target's features through HYBRID."""

from __future__ import annotations

import pytest
import torch

from sglang.test.eagle_fixtures import build_tiny_eagle3_head, build_tiny_eagle_head
from sglang.test.scheduler_driver import greedy, make_scheduler, run


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def head_dir(request, tiny_llama_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hybrid_head") / request.param)
    build = build_tiny_eagle_head if request.param == "eagle" else build_tiny_eagle3_head
    return build(tiny_llama_dir, out)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_scheduler(tiny_llama_dir)


def prompts(batch: int, seed: int):
    """Random text with a repeated stretch, so the n-grams have something to match."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        part = torch.randint(3, 3000, (12,), generator=g).tolist()
        out.append(part + torch.randint(3, 3000, (5,), generator=g).tolist() + part)
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_with_a_head_is_lossless(tiny_llama_dir, head_dir, plain, batch):
    ps = prompts(batch, seed=50 + batch)
    ref = run(plain, ps, [greedy(24)] * batch)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                           speculative_draft_model_path=head_dir, speculative_num_steps=3,
                           speculative_eagle_topk=2)
    assert type(sched.spec.drafter.model).__name__ in ("EagleDrafter", "Eagle3Drafter")
    assert sched.spec.capture_layers  # the target hands the head its features
    got = run(sched, ps, [greedy(24)] * batch)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert sched.spec.drafter.model.missing_features == 0
    sched.check_all_free()


def test_hybrid_with_a_head_reuses_the_radix_tree(tiny_llama_dir, head_dir, plain):
    doc = prompts(1, seed=61)[0] * 3
    qs = [doc + q for q in prompts(3, seed=62)]
    ref = run(plain, qs, [greedy(16)] * 3)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                           speculative_draft_model_path=head_dir, chunked_prefill_size=32)
    run(sched, qs[:1], [greedy(16)])
    got = run(sched, qs, [greedy(16)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert all(u.extra_meta["draft_cached_tokens"] >= 64 for _, u in got.values())
    assert sched.spec.drafter.model.missing_features == 0
    sched.flush_cache()
    sched.check_all_free()
