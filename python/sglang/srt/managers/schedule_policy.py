"""Order of admission for waiting requests: fcfs, or lpm (longest cached prefix first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

# Matching every waiting request against the tree costs time; upstream falls back to fcfs
# past this queue length, and so do we.
_LPM_MAX_QUEUE = 128


def order_waiting(policy: str, waiting: List["Req"], cache: "BasePrefixCache",
                  cache_disabled: bool) -> List["Req"]:
    if policy == "fcfs" or cache_disabled or len(waiting) > _LPM_MAX_QUEUE:
        return list(waiting)
    lengths = {id(r): cache.match_prefix(r.fill_ids[: max(r.fill_len - 1, 0)]).length
               for r in waiting}
    # sorted() is stable: ties keep arrival order.
    return sorted(waiting, key=lambda r: -lengths[id(r)])
