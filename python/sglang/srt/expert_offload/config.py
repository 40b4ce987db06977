"""OffloadConfig: the expert offload flags, built once from ServerArgs (defaults live there)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    cache_slots: Optional[int]  # experts per layer in the fast tier; None: all resident, no store
    drop_page_cache: bool  # drop expert pages after each load (real disk reads)
    predictor: str  # --moe-prefetch-predictor (expert_offload.predictors.PREDICTORS)
    width: int  # experts beyond top-k a router-based predictor fetches per token
    keep_width: int  # `draft`: experts beyond top-(k + width) kept from eviction
    min_prob: float  # `draft`: the calibrated pass-probability cut (0: fixed top-(k + width))
    gate: bool  # prefetch kept only where it measures faster (False: always on)
    prune_tree: bool  # budget-aware draft trees

    @classmethod
    def from_server_args(cls, args) -> "OffloadConfig":
        return cls(cache_slots=args.moe_expert_cache_slots,
                   drop_page_cache=args.moe_expert_drop_page_cache,
                   predictor=args.moe_prefetch_predictor,
                   width=args.moe_prefetch_width,
                   keep_width=args.moe_prefetch_keep_width,
                   min_prob=args.moe_prefetch_min_prob,
                   gate=not args.moe_prefetch_disable_gate,
                   prune_tree=args.moe_prefetch_prune_tree)

    @classmethod
    def slots_only(cls, cache_slots: Optional[int], drop_page_cache: bool = False) -> "OffloadConfig":
        """A store without prefetch (the loader's `moe_expert_cache_slots=` shorthand)."""
        from sglang.srt.server_args import ServerArgs

        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        return cls(cache_slots=cache_slots, drop_page_cache=drop_page_cache, predictor="none",
                   width=defaults["moe_prefetch_width"],
                   keep_width=defaults["moe_prefetch_keep_width"],
                   min_prob=defaults["moe_prefetch_min_prob"], gate=False, prune_tree=False)

    @property
    def enabled(self) -> bool:
        return self.cache_slots is not None

    @property
    def prefetching(self) -> bool:
        return self.enabled and self.predictor != "none"
