"""Drive an in-process Scheduler to completion (shared by the speculative tests)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from sglang.srt.managers.io_struct import ReqUpdate, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def make_scheduler(model_dir: str, **kw) -> Scheduler:
    kw.setdefault("max_total_tokens", 8192)
    if kw.get("speculative_algorithm"):
        # Tests that check acceptance want speculation on at every step: no cost model, no
        # fallback, unless the test asks for them.
        kw.setdefault("speculative_disable_cost_model", True)
        kw.setdefault("speculative_fallback_threshold", 0.0)
    return Scheduler(ServerArgs(model_path=model_dir, dtype="float32", **kw))


def run(sched: Scheduler, prompts: List[List[int]], params: List[Dict]) -> Dict[str, Tuple[List[int], ReqUpdate]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        upd = sched.add_request(TokenizedGenerateReqInput(
            rid=str(i), input_ids=p, sampling_params=SamplingParams.from_dict(dict(sp))))
        assert upd is None, upd
    outs: Dict[str, List[int]] = {}
    done = {}
    for _ in range(100_000):
        if sched.is_idle():
            break
        for u in sched.step():
            outs.setdefault(u.rid, []).extend(u.new_output_ids)
            if u.finished_reason is not None:
                done[u.rid] = (outs[u.rid], u)
    assert sched.is_idle()
    return done


def greedy(n: int = 20) -> Dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
