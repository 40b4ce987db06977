"""The one decode-rate rule of bench_spec_eval, shared by both engines' workers (no imports:
vLLM's environment loads it too)."""

from typing import List, Optional, Tuple


def decode_rate(stamps: List[Tuple[float, int]]) -> Optional[float]:
    """stamps: (time, tokens) per engine step that emitted tokens. Tokens after the first
    step over the time after it (the prefill is never in it); None below two steps."""
    if len(stamps) < 2:
        return None
    return (sum(n for _, n in stamps) - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])


def first_token_and_total(stamps: List[Tuple[float, int]], start: float
                          ) -> Tuple[Optional[float], Optional[float]]:
    """(seconds to the first token, tokens over seconds from the request to its last
    token): what a user waits for, the prefill and a draft's read of the prompt included
    (the decode rate leaves both out). `start`: when the request was added."""
    if not stamps:
        return None, None
    total = stamps[-1][0] - start
    return stamps[0][0] - start, (sum(n for _, n in stamps) / total if total > 0 else None)
