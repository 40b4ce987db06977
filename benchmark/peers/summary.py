"""What the peer harness computes from recorded event streams (no imports beyond the standard
library: every engine's environment loads the workers beside it, the parent summarises).

An event stream is what one request left: the time it was handed to the engine and one
(time, tokens) pair per moment the engine gave tokens back (one per engine step for ours,
vLLM and transformers; one per token for llama.cpp, whose bindings yield tokens singly).
Every engine is timed by the same rule on it:
- TTFT: first stamp minus the start (the prefill, and a draft's read of the prompt, in it);
- decode tok/s: tokens after the first stamp over the time after it (no prefill in it);
- end-to-end tok/s: all tokens over the time from the start to the last stamp.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

Stamp = Tuple[float, int]  # (time in seconds, tokens given back at that time)


@dataclasses.dataclass(frozen=True)
class Measure:
    ttft_s: Optional[float]
    decode_tok_s: Optional[float]
    e2e_tok_s: Optional[float]
    tokens: int
    steps: int  # stamps: engine steps that gave tokens (tokens, for llama.cpp)


def measure(start: float, stamps: Sequence[Stamp]) -> Measure:
    """The three figures of one request; None where the stream is too short for one (no
    stamp: no TTFT; one stamp: no decode rate) or a time difference is not positive."""
    stamps = [(float(t), int(n)) for t, n in stamps]
    tokens = sum(n for _, n in stamps)
    if not stamps:
        return Measure(None, None, None, 0, 0)
    if any(b[0] < a[0] for a, b in zip(stamps, stamps[1:])) or stamps[0][0] < start:
        raise ValueError("stamps must not go back in time, nor come before the start")
    ttft = stamps[0][0] - start
    span = stamps[-1][0] - stamps[0][0]
    decode = (tokens - stamps[0][1]) / span if len(stamps) >= 2 and span > 0 else None
    total = stamps[-1][0] - start
    e2e = tokens / total if total > 0 else None
    return Measure(ttft, decode, e2e, tokens, len(stamps))


@dataclasses.dataclass(frozen=True)
class Spread:
    median: Optional[float]
    low: Optional[float]
    high: Optional[float]
    n: int  # rounds with a value


def spread(values: Sequence[Optional[float]], digits: int = 3) -> Spread:
    """Median and range over rounds, the rounds without a value left out."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return Spread(None, None, None, 0)
    return Spread(round(statistics.median(vals), digits), round(min(vals), digits),
                  round(max(vals), digits), len(vals))


def agree_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens from the start on which two outputs agree."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_check(measured: Optional[float], reference: Optional[float],
                    tolerance: float = 0.15) -> Dict[str, object]:
    """A peer's plain speed beside its reference on this kind of machine: flagged when it is
    more than `tolerance` below it (a peer badly set up is not a result). No reference or no
    measurement: not flagged, said so."""
    if reference is None or measured is None:
        return {"reference_tok_s": reference, "ratio": None, "far_below": False,
                "checked": False}
    ratio = measured / reference
    return {"reference_tok_s": reference, "ratio": round(ratio, 3),
            "far_below": ratio < 1.0 - tolerance, "checked": True}


def summarize(runs: Dict[str, List[Dict]], plain_of: Dict[str, str], ours_plain: str,
              references: Dict[Tuple[str, str], float]) -> Dict[str, Dict[str, Dict]]:
    """One row per prompt, one cell per configuration.

    runs: configuration -> its records ({"prompt", "round", "start", "stamps", "output_ids"}).
    plain_of: configuration -> the same engine's plain configuration (its tokens are the
    reference for agreement, its speed the base of `x_own_plain`).
    references: (configuration, prompt) -> reference decode tok/s (plain configurations)."""
    prompts: List[str] = []
    for recs in runs.values():
        for r in recs:
            if r["prompt"] not in prompts:
                prompts.append(r["prompt"])
    table: Dict[str, Dict[str, Dict]] = {}
    for p in prompts:
        row: Dict[str, Dict] = {}
        for cfg, recs in runs.items():
            mine = sorted((r for r in recs if r["prompt"] == p), key=lambda r: r["round"])
            if not mine:
                continue
            ms = [measure(r["start"], r["stamps"]) for r in mine]
            base = {r["round"]: r["output_ids"] for r in runs.get(plain_of.get(cfg, cfg), [])
                    if r["prompt"] == p}
            agree = [agree_prefix(r["output_ids"], base.get(r["round"], r["output_ids"]))
                     for r in mine]
            cell = {"decode_tok_s": dataclasses.asdict(spread([m.decode_tok_s for m in ms], 2)),
                    "ttft_s": dataclasses.asdict(spread([m.ttft_s for m in ms], 3)),
                    "e2e_tok_s": dataclasses.asdict(spread([m.e2e_tok_s for m in ms], 2)),
                    "tokens": ms[-1].tokens, "steps": [m.steps for m in ms],
                    "agree_with_own_plain": min(agree),
                    "same_as_own_plain": all(a == len(r["output_ids"])
                                             for a, r in zip(agree, mine))}
            ref = references.get((cfg, p))
            if ref is not None:
                cell["reference"] = reference_check(cell["decode_tok_s"]["median"], ref)
            row[cfg] = cell
        for cfg, cell in row.items():
            v = cell["decode_tok_s"]["median"]
            own = row.get(plain_of.get(cfg, cfg), {}).get("decode_tok_s", {}).get("median")
            ours = row.get(ours_plain, {}).get("decode_tok_s", {}).get("median")
            cell["x_own_plain"] = round(v / own, 3) if v and own else None
            cell["x_our_plain"] = round(v / ours, 3) if v and ours else None
        table[p] = row
    return table
