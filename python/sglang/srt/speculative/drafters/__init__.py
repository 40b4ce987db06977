"""Drafters by algorithm name (sglang.srt.registry.SPECULATIVE_ALGORITHMS)."""

from __future__ import annotations

from sglang.srt.registry import SPECULATIVE_ALGORITHMS
from sglang.srt.speculative.config import SpecConfig
from sglang.srt.speculative.drafters.base import Drafter


def build_drafter(cfg: SpecConfig, server_args, max_running: int, context_len: int,
                  max_total_tokens: int, chunk_size: int) -> Drafter:
    build = SPECULATIVE_ALGORITHMS.load(cfg.algorithm)
    return build(cfg, server_args, max_running, context_len, max_total_tokens, chunk_size)
