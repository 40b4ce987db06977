"""SpecConfig: the speculative decoding flags, built once from ServerArgs (defaults live there)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang.srt.speculative.controller import FallbackConfig


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # STANDALONE | NGRAM | HYBRID | EAGLE | EAGLE3 | NEXTN (upper case)
    draft_model_path: Optional[str]
    num_steps: int  # draft levels per proposal
    topk: int  # branches per level
    num_draft_tokens: int  # tree nodes per request, the root included
    fallback: FallbackConfig
    cost_model: bool  # choose the budget by measured speed (False: always num_draft_tokens)
    calibrate_seconds: float

    @classmethod
    def from_server_args(cls, args) -> Optional["SpecConfig"]:
        """None when speculation is off."""
        if not args.speculative_algorithm:
            return None
        algo = args.speculative_algorithm.upper()
        steps, topk, draft = resolve_spec_defaults(args)
        return cls(algorithm=algo, draft_model_path=args.speculative_draft_model_path,
                   num_steps=steps, topk=topk, num_draft_tokens=draft,
                   fallback=FallbackConfig(args.speculative_fallback_window,
                                           args.speculative_fallback_threshold,
                                           args.speculative_reprobe_interval),
                   cost_model=not args.speculative_disable_cost_model,
                   calibrate_seconds=args.speculative_calibrate_seconds)

    @property
    def uses_draft_model(self) -> bool:
        return self.algorithm != "NGRAM"

    @property
    def ngram_depth(self) -> int:
        return max(self.num_draft_tokens - 1, 1)


def resolve_spec_defaults(server_args):
    """(num_steps, topk, num_draft_tokens) with upstream's automatic defaults."""
    algo = server_args.speculative_algorithm.upper()
    if algo == "NGRAM":
        steps = server_args.speculative_num_steps or server_args.speculative_ngram_max_trie_depth
        topk = server_args.speculative_eagle_topk or 1
        # 10 nodes: a verify reads each weight once (the CPU kernel sweeps up to 10 rows at
        # a time; 12 rows cost 2.9-3.3 plain steps against 1.9-2.4, docs/decisions.md)
        draft = server_args.speculative_num_draft_tokens or 10
        return steps, topk, draft
    steps = server_args.speculative_num_steps or 3
    topk = server_args.speculative_eagle_topk or 1
    draft = server_args.speculative_num_draft_tokens
    if algo == "HYBRID":  # room for n-gram chains as long as NGRAM's beside the draft's
        return steps, topk, draft or max(steps * topk + 1, 10)
    if topk == 1:
        draft = steps + 1  # a chain: the root plus one token per step
    elif draft is None:
        draft = min(steps * topk, 8) + 1
    return steps, topk, draft
