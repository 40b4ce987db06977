"""The prefix cache interface: match -> lock -> use -> unlock, behind an opaque handle.

A prefix cache maps token sequences to the KV slots that hold their K/V (target slots and,
optionally, draft slots of the same tokens). Callers never see tree nodes: `match_prefix`
returns a `MatchResult` whose `handle` they lock while they use its indices.

Ownership of slots (the rule that keeps "no slot leaks, no slot freed twice" true):
- Slots returned by `match_prefix` / `cache_unfinished` / `draft_indices` belong to the cache;
  they are only valid while the handle is locked, and the caller never frees them.
- `insert(key, slots)` returns `n`, the length already present: the tail `slots[n:]` now
  belongs to the cache; the caller frees its own duplicates among `slots[:n]`. Every draft
  slot passed to `insert` belongs to the cache afterwards (kept, or freed if duplicated).
- `cache_finished` / `cache_unfinished` do that bookkeeping themselves: after them the
  request owns nothing of `slots` (nor of `draft_slots` up to `len(draft_indices(handle))`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator

Key = Union[Sequence[int], torch.Tensor]


@dataclass(frozen=True, eq=False)
class CacheHandle:
    """Opaque reference to a cached prefix. `length` = tokens from the start of the key."""

    node: Any  # the cache's own node object; callers must not touch it
    length: int


def _empty_indices() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


@dataclass
class MatchResult:
    """Result of `match_prefix`. Indices are only valid while `handle` is locked."""

    indices: torch.Tensor  # [length] int64 target KV slots of the matched prefix
    handle: CacheHandle
    length: int
    # [draft_length] int64 draft KV slots; draft_length <= length (a prefix of the match)
    draft_indices: torch.Tensor = field(default_factory=_empty_indices)
    draft_length: int = 0


class BasePrefixCache(abc.ABC):
    """Abstract prefix cache. See the module docstring for the ownership rules."""

    allocator: "TokenSlotAllocator"
    draft_allocator: Optional["TokenSlotAllocator"]

    @abc.abstractmethod
    def match_prefix(self, key: Key) -> MatchResult:
        """Longest cached prefix of `key` (touches it for eviction order)."""

    @abc.abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction until `unlock`."""

    @abc.abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one `lock` of the same handle."""

    @abc.abstractmethod
    def insert(self, key: Key, slots: torch.Tensor,
               draft_slots: Optional[torch.Tensor] = None) -> int:
        """Insert `key` -> `slots` (`draft_slots` covers a prefix of key); return the
        length of the prefix that was already present."""

    @abc.abstractmethod
    def cache_finished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                       draft_slots: Optional[torch.Tensor] = None) -> None:
        """A request ends: keep its KV in the cache, free duplicates, release its lock."""

    @abc.abstractmethod
    def cache_unfinished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                         draft_slots: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, CacheHandle]:
        """A request goes on: share its KV so far. Returns the canonical indices of `key`
        (to write back into the request's row) and the new handle, already locked
        (the old one is unlocked)."""

    def draft_indices(self, handle: CacheHandle) -> torch.Tensor:
        """Draft slots the cache holds for a prefix of the handle's key (valid while locked).
        After `cache_unfinished`, the caller's draft positions [0, len(result)) are these."""
        return _empty_indices()

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` target slots if possible; return the number freed."""

    def evict_draft(self, num_tokens: int) -> int:
        """Free draft slots (keeping the nodes); return the number freed."""
        return 0

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens the cache could free by `evict` (unlocked)."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens held by locked prefixes."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def draft_total_size(self) -> int:
        return 0

    @abc.abstractmethod
    def reset(self) -> None:
        """Free every slot the cache owns and return to empty (no lock may be held)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError (with a message) if an internal invariant is broken."""


def create_prefix_cache(disable: bool, allocator: "TokenSlotAllocator",
                        draft_allocator: Optional["TokenSlotAllocator"] = None,
                        eviction_policy: str = "lru") -> BasePrefixCache:
    """`--disable-radix-cache` -> ChunkCache (no sharing); otherwise a RadixCache."""
    if disable:
        from sglang.srt.mem_cache.chunk_cache import ChunkCache

        return ChunkCache(allocator, draft_allocator)
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(allocator, draft_allocator, eviction_policy=eviction_policy)


def as_key(key: Key) -> List[int]:
    """Keys are python lists of ints inside the caches (converted once per call)."""
    if isinstance(key, list):
        return key
    if isinstance(key, torch.Tensor):
        return key.tolist()
    return list(key)
