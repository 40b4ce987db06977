"""Scheduler behaviour on a tiny random Llama, in-process (no subprocesses).

Every scenario ends with check_all_free(): no KV slot or request row leaks.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def make_scheduler(model_dir: str, **kw) -> Scheduler:
    args = ServerArgs(model_path=model_dir, dtype="float32", **kw)
    return Scheduler(args)


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 4000, (L,), generator=g).tolist() for L in lens]


def run(sched: Scheduler, reqs, max_steps: int = 10_000):
    """Submit (rid, ids, params) tuples, step until idle; return rid -> finished update."""
    done = {}
    for rid, ids, params in reqs:
        upd = sched.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids,
                                                          sampling_params=params))
        assert upd is None, upd
    outputs = {}
    for _ in range(max_steps):
        if sched.is_idle():
            break
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_output_ids)
            if u.finished_reason is not None:
                done[u.rid] = (outputs[u.rid], u)
    assert sched.is_idle(), "scheduler did not finish"
    return done


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def sched(tiny_llama_dir):
    return make_scheduler(tiny_llama_dir, max_total_tokens=4096)


def test_batch_equals_one_by_one(sched):
    ps = prompts(5)
    batch = run(sched, [(f"b{i}", p, greedy()) for i, p in enumerate(ps)])
    sched.check_all_free()
    for i, p in enumerate(ps):
        alone = run(sched, [(f"a{i}", p, greedy())])
        assert alone[f"a{i}"][0] == batch[f"b{i}"][0]
        sched.check_all_free()


def test_chunked_prefill_equals_unchunked(tiny_llama_dir, sched):
    ps = prompts(3, seed=1, lo=60, hi=120)
    whole = run(sched, [(f"w{i}", p, greedy()) for i, p in enumerate(ps)])
    sched.check_all_free()
    chunked = make_scheduler(tiny_llama_dir, max_total_tokens=4096, chunked_prefill_size=16)
    parts = run(chunked, [(f"c{i}", p, greedy()) for i, p in enumerate(ps)])
    for i in range(len(ps)):
        assert parts[f"c{i}"][0] == whole[f"w{i}"][0]
    chunked.check_all_free()


def test_radix_hit_equals_miss_and_reports_cached_tokens(sched):
    doc = prompts(1, seed=2, lo=80, hi=81)[0]
    first = run(sched, [("miss", doc + [11, 12], greedy())])["miss"]
    assert first[1].cached_tokens == 0
    second = run(sched, [("hit", doc + [11, 12], greedy())])["hit"]
    assert second[0] == first[0]
    # Everything but the last prompt token can come from the cache.
    assert second[1].cached_tokens == len(doc) + 1
    other = run(sched, [("other", doc + [13], greedy())])["other"]
    assert other[1].cached_tokens == len(doc)
    sched.check_all_free()


def test_retraction_resumes_without_loss(tiny_llama_dir, sched):
    ps = prompts(6, seed=3, lo=30, hi=50)
    reference = run(sched, [(f"r{i}", p, greedy(40)) for i, p in enumerate(ps)])
    sched.check_all_free()
    # A pool too small for all six at once: the scheduler must retract and resume.
    small = make_scheduler(tiny_llama_dir, max_total_tokens=200, disable_radix_cache=False)
    got = run(small, [(f"s{i}", p, greedy(40)) for i, p in enumerate(ps)])
    assert sum(u.total_retractions for _, u in got.values()) > 0
    for i in range(len(ps)):
        assert got[f"s{i}"][0] == reference[f"r{i}"][0]
        assert got[f"s{i}"][1].finished_reason["type"] == "length"
    small.check_all_free()


def test_max_new_tokens_zero_prefills_and_caches(sched):
    doc = prompts(1, seed=4, lo=50, hi=51)[0]
    warm = run(sched, [("warm", doc, greedy(0))])["warm"]
    assert warm[0] == [] and warm[1].finished_reason == {"type": "length", "length": 0}
    q = run(sched, [("q", doc + [7, 8, 9], greedy(4))])["q"]
    assert q[1].cached_tokens == len(doc)
    sched.check_all_free()


def test_abort_frees_memory(sched):
    ps = prompts(3, seed=5)
    for i, p in enumerate(ps):
        sched.add_request(TokenizedGenerateReqInput(rid=f"x{i}", input_ids=p,
                                                    sampling_params=greedy(50)))
    sched.step()
    sched.step()
    updates = sched.abort("x1")
    assert updates and updates[0].finished_reason["type"] == "abort"
    sched.abort("")
    assert sched.is_idle()
    sched.check_all_free()


def test_too_long_prompt_is_rejected_not_crashing(sched):
    upd = sched.add_request(TokenizedGenerateReqInput(
        rid="long", input_ids=[5] * (sched.context_len + 1), sampling_params=greedy()))
    assert upd.finished_reason["type"] == "abort"
    assert "context length" in upd.finished_reason["message"]
    assert sched.is_idle()


def test_sampling_seed_reproducible_in_any_batch(sched):
    p = prompts(1, seed=6)[0]
    params = lambda: SamplingParams.from_dict({"max_new_tokens": 12, "temperature": 1.0,
                                               "sampling_seed": 1234, "ignore_eos": True})
    alone = run(sched, [("s", p, params())])["s"][0]
    others = [(f"o{i}", q, SamplingParams.from_dict({"max_new_tokens": 12, "temperature": 0.7}))
              for i, q in enumerate(prompts(3, seed=7))]
    mixed = run(sched, others + [("s2", p, params())])["s2"][0]
    assert alone == mixed
    sched.check_all_free()


def test_lpm_policy_runs_all(tiny_llama_dir):
    s = make_scheduler(tiny_llama_dir, max_total_tokens=2048, schedule_policy="lpm")
    doc = prompts(1, seed=8, lo=40, hi=41)[0]
    got = run(s, [(f"l{i}", doc + [20 + i], greedy(4)) for i in range(4)])
    assert len(got) == 4
    s.check_all_free()
