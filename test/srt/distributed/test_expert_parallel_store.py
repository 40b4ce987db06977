"""Expert parallelism with the expert store: each of two real torch.distributed ranks (gloo,
one thread each) holds half the experts, its own store over them with fewer slots than it
owns, and its own prefetcher (draft-guided, or the ensemble whose cut counts every rank's
slots); the ranks load only their own experts, greedy
and sampled tokens equal one process without a store, and every pool and slot is free."""

from __future__ import annotations

import functools

import pytest
import torch

from sglang.test.scheduler_driver import make_scheduler, run
from sglang.test.tp_harness import run_ranks, scheduler_run

pytestmark = pytest.mark.slow  # spawns torch.distributed processes


def _params(n: int):
    return [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            {"max_new_tokens": n, "temperature": 0.9, "sampling_seed": 5, "ignore_eos": True}]


@pytest.mark.parametrize("arch, spec", [("qwen2_moe", "STANDALONE"), ("mixtral", None)])
def test_ep2_with_a_store_per_rank_equals_one_process(tiny_moe_dir, arch, spec):
    torch.set_num_threads(1)
    folder = tiny_moe_dir(arch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() * 3 for n in (6, 10)]
    params = _params(10)
    extra = {}
    if spec:  # the model drafts for itself: the draft-guided predictor gets its levels
        extra = dict(speculative_algorithm=spec, speculative_draft_model_path=folder,
                     speculative_num_steps=3)
    ref_sched = make_scheduler(folder, **extra)
    reference = {rid: ids for rid, (ids, _) in run(ref_sched, prompts, params).items()}
    ref_sched.check_all_free()
    kw = dict(tp_size=2, ep_size=2, moe_expert_cache_slots=2,
              moe_prefetch_predictor="draft" if spec else "ensemble", **extra)
    ranks = run_ranks(functools.partial(scheduler_run, folder, prompts, params, kw), ep_size=2)
    for rank, got in enumerate(ranks):
        assert got["tokens"] == reference, (arch, rank)
        owned = list(range(4 * rank, 4 * rank + 4))  # 8 experts, half on each rank
        assert got["owned"] == owned
        assert got["loaded"] and set(got["loaded"]) <= set(owned), (rank, got["loaded"])
        assert got["store"]["loads"] > 0  # 2 slots for 4 experts: the store worked
        figs = got["moe"]["moe_prefetch"]
        assert figs["total"]["uses"] > 0 and 0.0 <= figs["total"]["recall"] <= 1.0
