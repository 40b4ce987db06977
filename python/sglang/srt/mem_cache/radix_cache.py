"""Radix tree prefix cache (page size 1): token sequences -> target (and draft) KV slots.

Invariants (checked by `check_integrity`):
- every non-root node has a non-empty key, a value (int64 slots) of the same length, and
  optionally draft slots of the same length; children are keyed by their first token;
- `lock_ref(node) = handle locks on node + sum(lock_ref(child))`; the root is never evicted;
- evictable/protected counters equal a recount (unlocked / locked tokens);
- a slot appears at most once in the tree and is never free in its allocator;
- draft slots are prefix-closed: a node with draft slots has a parent with draft slots (or
  the root), so a path's draft prefix is contiguous and eviction drops it from the end.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from sglang.srt.mem_cache.base_prefix_cache import (BasePrefixCache, CacheHandle, Key,
                                                    MatchResult, as_key)
from sglang.srt.mem_cache.radix_integrity import check_radix_integrity

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator

_CHUNK = 256  # tokens compared per list-slice comparison when looking for a mismatch


class TreeNode:
    __slots__ = ("id", "key", "value", "draft_value", "parent", "children", "lock_ref",
                 "handle_locks", "last_access_time", "creation_time", "hit_count")

    def __init__(self, node_id: int, key: List[int], value: torch.Tensor,
                 parent: Optional["TreeNode"], now: int) -> None:
        self.id = node_id
        self.key = key  # token ids of this segment
        self.value = value  # [len(key)] int64 target slots
        self.draft_value: Optional[torch.Tensor] = None  # [len(key)] int64 draft slots
        self.parent = parent  # None for the root and for evicted nodes
        self.children: Dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.handle_locks = 0  # locks taken on this very node through a handle
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0


def _match_len(node_key: List[int], key: List[int], pos: int) -> int:
    """Length of the common prefix of node_key and key[pos:], comparing slices in C."""
    n = min(len(node_key), len(key) - pos)
    if node_key[:n] == key[pos:pos + n]:
        return n
    i = 0
    while i < n and node_key[i:i + _CHUNK] == key[pos + i:pos + i + _CHUNK]:
        i += _CHUNK
    while node_key[i] == key[pos + i]:  # a mismatch exists below n
        i += 1
    return i


_POLICIES: Dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda n: (n.last_access_time, n.id),
    "lfu": lambda n: (n.hit_count, n.last_access_time, n.id),
    "fifo": lambda n: (n.creation_time, n.id),
    "mru": lambda n: (-n.last_access_time, n.id),
    "filo": lambda n: (-n.creation_time, n.id),
}


class RadixCache(BasePrefixCache):
    def __init__(self, allocator: "TokenSlotAllocator",
                 draft_allocator: Optional["TokenSlotAllocator"] = None,
                 eviction_policy: str = "lru") -> None:
        if eviction_policy not in _POLICIES:
            raise ValueError(f"--radix-eviction-policy must be one of {sorted(_POLICIES)}, "
                             f"got {eviction_policy!r}")
        self.allocator = allocator
        self.draft_allocator = draft_allocator
        self.device = allocator.device
        self._priority = _POLICIES[eviction_policy]
        self._init_tree()

    def _init_tree(self) -> None:
        """Empty tree; forgets slots without freeing them (see `reset`)."""
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node([], self._empty(), None)
        self.root.lock_ref = 1  # never evictable, never counted
        self._evictable = 0
        self._protected = 0
        self._draft_evictable = 0
        self._draft_protected = 0
        self._evictable_leaves: Set[TreeNode] = set()

    # ------------------------------------------------------------------ helpers
    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: List[int], value: torch.Tensor, parent: Optional[TreeNode]
                  ) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, key, value, parent, self._tick())

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Split `node` after m tokens; return the new upper node (same lock_ref)."""
        upper = self._new_node(node.key[:m], node.value[:m], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access_time = node.last_access_time
        upper.creation_time = node.creation_time
        upper.hit_count = node.hit_count
        if node.draft_value is not None:
            upper.draft_value = node.draft_value[:m]
            node.draft_value = node.draft_value[m:]
        node.parent.children[node.key[0]] = upper
        node.key, node.value = node.key[m:], node.value[m:]
        upper.children[node.key[0]] = node
        node.parent = upper
        return upper

    def _add_sizes(self, node: TreeNode, sign: int) -> None:
        n = len(node.key) * sign
        d = 0 if node.draft_value is None else len(node.draft_value) * sign
        if node.lock_ref > 0:
            self._protected += n
            self._draft_protected += d
        else:
            self._evictable += n
            self._draft_evictable += d

    def _set_draft(self, node: TreeNode, draft: Optional[torch.Tensor]) -> None:
        self._add_sizes(node, -1)
        node.draft_value = draft
        self._add_sizes(node, +1)

    def _path_draft(self, node: TreeNode) -> torch.Tensor:
        parts: List[torch.Tensor] = []
        while node is not self.root:
            if node.draft_value is None:
                parts.clear()  # prefix-closed: only the nodes above a gap count
            else:
                parts.append(node.draft_value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else self._empty()

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: Key) -> MatchResult:
        key = as_key(key)
        now = self._tick()
        node, pos = self.root, 0
        values: List[torch.Tensor] = []
        drafts: List[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            m = _match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access_time = now
            child.hit_count += 1
            values.append(child.value)
            if child.draft_value is not None and len(drafts) == len(values) - 1:
                drafts.append(child.draft_value)
            node, pos = child, pos + m
        indices = torch.cat(values) if values else self._empty()
        draft = torch.cat(drafts) if drafts else self._empty()
        return MatchResult(indices, CacheHandle(node, pos), pos, draft, len(draft))

    def insert(self, key: Key, slots: torch.Tensor,
               draft_slots: Optional[torch.Tensor] = None) -> int:
        return self._insert(as_key(key), slots, draft_slots)[0]

    def _insert(self, key: List[int], slots: torch.Tensor, draft: Optional[torch.Tensor]
                ) -> Tuple[int, TreeNode, List[torch.Tensor]]:
        """Returns (length already present, last node of key, values along the path)."""
        if len(slots) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        d = 0 if draft is None else len(draft)
        if d and self.draft_allocator is None:
            raise ValueError("insert: draft slots given but the cache has no draft allocator")
        if d > len(key):
            raise ValueError(f"insert: {d} draft slots for a key of {len(key)} tokens")
        now = self._tick()
        node, pos = self.root, 0
        values: List[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            m = _match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            if child.draft_value is None and pos < d < pos + m:
                child = self._split(child, d - pos)  # so the part with drafts can adopt them
            m = len(child.key)
            child.last_access_time = now
            if pos < d:
                mine = draft[pos:pos + m]
                if child.draft_value is None:
                    self._set_draft(child, mine.clone())
                else:  # free the caller's duplicates, not slots the tree already holds
                    self.draft_allocator.free(mine[mine != child.draft_value[:len(mine)]])
            values.append(child.value)
            node, pos = child, pos + m
        prefix_len = pos
        for end in sorted({min(max(d, pos), len(key)), len(key)}):
            if end <= pos:
                continue
            leaf = self._new_node(key[pos:end], slots[pos:end].clone(), node)
            if pos < d:
                leaf.draft_value = draft[pos:end].clone()
            self._evictable_leaves.discard(node)
            node.children[key[pos]] = leaf
            self._add_sizes(leaf, +1)  # leaf.lock_ref == 0: evictable
            self._evictable_leaves.add(leaf)
            values.append(leaf.value)
            node, pos = leaf, end
        return prefix_len, node, values

    # ------------------------------------------------------------------ request life cycle
    def _cache(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
               draft_slots: Optional[torch.Tensor]) -> Tuple[torch.Tensor, TreeNode]:
        key = as_key(key)
        prefix_len, node, values = self._insert(key, slots, draft_slots)
        canonical = torch.cat(values) if values else self._empty()
        dup = slots[:prefix_len] != canonical[:prefix_len]
        if bool(dup[:old_handle.length].any()):
            raise AssertionError("the request's prefix slots differ from its locked prefix")
        self.allocator.free(slots[:prefix_len][dup])
        return canonical, node

    def cache_finished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                       draft_slots: Optional[torch.Tensor] = None) -> None:
        self._cache(key, slots, old_handle, draft_slots)
        self.unlock(old_handle)

    def cache_unfinished(self, key: Key, slots: torch.Tensor, old_handle: CacheHandle,
                         draft_slots: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, CacheHandle]:
        canonical, node = self._cache(key, slots, old_handle, draft_slots)
        handle = CacheHandle(node, len(canonical))
        self.lock(handle)  # lock the new path before unlocking the old (shared) one
        self.unlock(old_handle)
        return canonical, handle

    def draft_indices(self, handle: CacheHandle) -> torch.Tensor:
        return self._path_draft(handle.node)

    # ------------------------------------------------------------------ locking
    def lock(self, handle: CacheHandle) -> None:
        node = handle.node
        if node is self.root:
            return
        if node.parent is None:
            raise AssertionError("lock: the handle's prefix was evicted (lock before use)")
        node.handle_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._add_sizes(node, -1)
                node.lock_ref = 1
                self._add_sizes(node, +1)
                self._evictable_leaves.discard(node)
            else:
                node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        node = handle.node
        if node is self.root:
            return
        if node.handle_locks <= 0:
            raise AssertionError("unlock: the handle is not locked")
        node.handle_locks -= 1
        while node is not self.root:
            if node.lock_ref == 1:
                self._add_sizes(node, -1)
                node.lock_ref = 0
                self._add_sizes(node, +1)
                if not node.children:
                    self._evictable_leaves.add(node)
            else:
                node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        heap = [(self._priority(n), n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[1]
            self.allocator.free(node.value)
            if node.draft_value is not None:
                self.draft_allocator.free(node.draft_value)
            freed += len(node.value)
            self._add_sizes(node, -1)
            self._evictable_leaves.discard(node)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None  # marks the node (and stale handles to it) as evicted
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (self._priority(parent), parent))
        return freed

    def evict_draft(self, num_tokens: int) -> int:
        """Drop draft slots of unlocked nodes, deepest first (keeps drafts prefix-closed)."""
        def droppable(n: TreeNode) -> bool:
            return (n is not self.root and n.draft_value is not None and n.lock_ref == 0
                    and all(c.draft_value is None for c in n.children.values()))

        heap = [(self._priority(n), n) for n in self.nodes() if droppable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[1]
            self.draft_allocator.free(node.draft_value)
            freed += len(node.draft_value)
            self._set_draft(node, None)
            if droppable(node.parent):
                heapq.heappush(heap, (self._priority(node.parent), node.parent))
        return freed

    # ------------------------------------------------------------------ sizes, reset, checks
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def draft_evictable_size(self) -> int:
        return self._draft_evictable

    def draft_total_size(self) -> int:
        return self._draft_evictable + self._draft_protected

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset: {self._protected} cached tokens are still locked "
                               "by running requests")
        for node in self.nodes():
            self.allocator.free(node.value)
            if node.draft_value is not None:
                self.draft_allocator.free(node.draft_value)
        self._init_tree()

    def check_integrity(self) -> None:
        check_radix_integrity(self)
