"""The one decode-rate rule of bench_spec_eval, shared by both engines' workers (no imports:
vLLM's environment loads it too)."""

from typing import List, Optional, Tuple


def decode_rate(stamps: List[Tuple[float, int]]) -> Optional[float]:
    """stamps: (time, tokens) per engine step that emitted tokens. Tokens after the first
    step over the time after it (the prefill is never in it); None below two steps."""
    if len(stamps) < 2:
        return None
    return (sum(n for _, n in stamps) - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])
