"""ChunkCache: the prefix-cache interface with no sharing (`--disable-radix-cache`).

Nothing is ever matched or kept: a request owns its slots until it finishes, and then they
are freed. Sizes are always zero, so eviction never frees anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from sglang.srt.mem_cache.base_prefix_cache import (BasePrefixCache, CacheHandle, Key,
                                                    MatchResult)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator


class ChunkCache(BasePrefixCache):
    def __init__(self, allocator: "TokenSlotAllocator",
                 draft_allocator: Optional["TokenSlotAllocator"] = None) -> None:
        self.allocator = allocator
        self.draft_allocator = draft_allocator
        self._empty_handle = CacheHandle(None, 0)

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.allocator.device)

    def match_prefix(self, key: Key) -> MatchResult:
        return MatchResult(self._empty(), self._empty_handle, 0, self._empty(), 0)

    def lock(self, handle: CacheHandle) -> None:
        pass

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def insert(self, key: Key, slots: torch.Tensor,
               draft_slots: Optional[torch.Tensor] = None) -> int:
        # Nothing was present, so the cache owns every slot now, and it keeps none.
        self._free(slots, draft_slots)
        return 0

    def cache_finished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                       draft_slots: Optional[torch.Tensor] = None) -> None:
        self._free(slots, draft_slots)

    def cache_unfinished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                         draft_slots: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, CacheHandle]:
        # The request keeps owning its slots (and draft slots: draft_indices() is empty).
        return slots, self._empty_handle

    def draft_indices(self, handle: CacheHandle) -> torch.Tensor:
        return self._empty()

    def _free(self, slots: torch.Tensor, draft_slots: Optional[torch.Tensor]) -> None:
        self.allocator.free(slots)
        if draft_slots is not None and len(draft_slots):
            if self.draft_allocator is None:
                raise ValueError("draft slots given but the cache has no draft allocator")
            self.draft_allocator.free(draft_slots)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass
