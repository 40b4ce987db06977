"""Start-up calibration of the speculative cost model.

A fresh server knows nothing of what a speculative step costs at each batch size, and
exploring with real requests costs them time (docs/decisions.md). Like CUDA-graph capture
per batch size, this runs the steps once before the server reports ready: dummy requests of random tokens at growing batch sizes, each budget
run for as many steps as the cost model wants before it trusts an option. Acceptance is not
learned here (random text drafts unlike real text): the model keeps its prior, and the first
real step of an option replaces its start-up time.

The calibration stops at the batch size where every speculative budget loses to plain
decoding at the prior acceptance (a bigger batch makes verify tokens dearer, not cheaper),
or when its time is spent. Everything it allocates is freed: pools are all-free afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.distributed.parallel_state import rank0_value
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.budget_policy import FixedBudget
from sglang.srt.utils.stats import batch_bucket, bucket_sizes

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 32  # short: a step's cost here is weights and batch, not attention
PHRASE_TOKENS = 8
# Steps timed per (batch size, budget); the cost model keeps the fastest: one sample caught
# in a slow moment of a shared host can rule speculation out for a whole run.
SAMPLES = 2


@dataclasses.dataclass
class CalibrationReport:
    """What the calibration measured (shown in /server_info as `spec_calibration`)."""

    seconds: float = 0.0
    batch_sizes: List[int] = dataclasses.field(default_factory=list)
    # "batch/budget" -> fastest step seconds (budget 1 = plain decoding)
    step_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    stopped: str = ""  # why it stopped

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(scheduler, seconds: float) -> Optional[CalibrationReport]:
    """Time plain and speculative steps at growing batch sizes into the scheduler's cost
    model, for at most about `seconds`. None when there is nothing to calibrate."""
    spec = scheduler.spec
    if (spec is None or spec.cost_model is None or seconds <= 0 or not scheduler.is_idle()
            or not spec.draft_kv.enabled):
        # NGRAM has no draft model: its trees depend on the text (random prompts find
        # none past the first generated token) and its step is the verify alone, cheap to
        # explore online
        return None
    model = spec.cost_model
    report = CalibrationReport()
    # Calibration requests are not traffic: keep acceptance, counters and stats as they were,
    # and the price of a draft token unknown: reading 32-token prompts is mostly a forward's
    # fixed cost, and priced per token it made the draft's read of a real prompt look dear
    # enough that the 1-request sweep decoded plainly where speculation won.
    kept, stats = spec.learned_state(), dict(scheduler.stats)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    vocab = scheduler.runner.vocab_size
    # ordinary ids: clear of the usual special ids at the start and of padded rows at the end
    low, high = min(100, vocab // 2), min(vocab, 30000)
    # enough that no request finishes early
    new_tokens = 2 + max(model.budgets) + SAMPLES * sum(model.budgets)
    per_request = 0.0  # seconds the last batch size took, per request
    try:
        for bs in bucket_sizes(scheduler.max_running):  # the cost model's buckets
            if bs * (PROMPT_TOKENS + new_tokens + spec.max_tree_nodes) > scheduler.allocator.size:
                report.stopped = f"KV pool too small for {bs} calibration requests"
                break
            spent = rank0_value(time.perf_counter() - start)  # TP ranks decide alike
            # a batch costs at most about its size times the last one's per request (the
            # CPU is compute-bound; on a GPU it is far less)
            if spent + per_request * bs > seconds:
                report.stopped = f"time spent ({spent:.1f} of {seconds:g} s)"
                break
            t0 = time.perf_counter()
            _run_batch(scheduler, bs, gen, (low, high), new_tokens)
            per_request = rank0_value(time.perf_counter() - t0) / bs
            report.batch_sizes.append(bs)
            rates = [spec.rate_prior] * bs
            if model.rules_out_speculation(rates, spec.depth_of):
                report.stopped = f"speculation loses to plain decoding at {bs} requests"
                break
        else:
            report.stopped = "every batch size up to --max-running-requests"
    finally:
        spec.use_policy(None)
        spec.restore_learned_state(kept)
        scheduler.stats.clear()
        scheduler.stats.update(stats)
        scheduler.flush_cache()
    report.seconds = time.perf_counter() - start
    report.step_seconds = {f"{bs}/{b}": round(t, 4) for (bs, b), t in sorted(model.times.items())}
    logger.info("speculation calibrated in %.1f s at batch sizes %s (%s)", report.seconds,
                report.batch_sizes, report.stopped)
    return report


def _run_batch(scheduler, bs: int, gen: torch.Generator, id_range: Tuple[int, int],
               new_tokens: int) -> None:
    """Prefill `bs` random prompts, then time each budget the cost model may still want at
    this batch size; abort the requests (their KV goes back to the pools)."""
    spec, model = scheduler.spec, scheduler.spec.cost_model
    rids = [f"CALIBRATE-{bs}-{i}" for i in range(bs)]
    for rid in rids:
        # a random phrase said over and over: HYBRID's n-grams find candidates in it
        phrase = torch.randint(*id_range, (PHRASE_TOKENS,), generator=gen).tolist()
        ids = (phrase * (PROMPT_TOKENS // PHRASE_TOKENS + 1))[:PROMPT_TOKENS]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        params.normalize()
        scheduler.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids,
                                                        sampling_params=params))
    try:
        spec.use_policy(FixedBudget(1))  # prefill (the draft warms on every prompt), then plain
        for _ in range(64):  # prefill chunks (bounded: never spin at start-up)
            if all(r.output_ids for r in scheduler.running) and not scheduler.waiting:
                break
            scheduler.step()
        if len(scheduler.running) != bs:
            return  # the pool could not hold them all at once: nothing typical to time
        rates = [spec.rate_prior] * bs
        for budget in model.budgets:
            # the exploration rule: skip a budget that cannot win even at the cost of the
            # smaller ones just measured, or that lost at a smaller batch
            if budget > 1 and budget not in model.open_budgets(batch_bucket(bs), rates,
                                                               spec.depth_of):
                continue
            spec.use_policy(FixedBudget(budget))
            for _ in range(SAMPLES):
                scheduler.step()
    finally:
        spec.use_policy(None)
        for rid in rids:
            scheduler.abort(rid, "calibration done")
