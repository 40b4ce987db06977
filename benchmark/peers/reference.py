"""Each peer's known plain decode speed on this kind of machine (2 shared cores, greedy, batch
1, 64 new tokens, a GDPR prompt), from `../shared/reference/real-weights-and-data.md`
("Peers measured on this kind of machine"). The harness checks its plain runs against them:
a peer far below its figure was set up badly (threads, binding, dtype), not measured."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

# (engine, model, dtype) -> {context tokens: decode tok/s}. The table's machine had AVX-512;
# on an AVX2 host bf16 kernels differ, so a flag there is a question, not a verdict.
REFERENCE: Dict[Tuple[str, str, str], Dict[int, float]] = {
    ("transformers", "0.5b", "bfloat16"): {1024: 9.39, 4096: 5.87, 8192: 3.90},
    ("transformers", "1.5b", "bfloat16"): {1024: 3.77, 4096: 2.53},
    ("vllm", "0.5b", "bfloat16"): {1024: 22.1, 4096: 23.2},
    ("llama.cpp", "0.5b", "q4_k_m"): {1024: 40.6, 4096: 28.1},
    ("llama.cpp", "1.5b", "q4_k_m"): {1024: 28.6, 4096: 20.3},
}


def reference_for(engine: str, model: str, dtype: str, context: int) -> Optional[float]:
    """The figure at the nearest recorded context within 25% of `context`, else None (no
    figure for that length is no check, not a guess)."""
    table = REFERENCE.get((engine, model, dtype))
    if not table:
        return None
    near = min(table, key=lambda c: abs(c - context))
    return table[near] if abs(near - context) <= 0.25 * context else None
