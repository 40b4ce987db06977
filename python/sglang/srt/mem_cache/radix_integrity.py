"""The radix cache's invariants (radix_cache.py's docstring lists them), checked by a full
recount: tests and debug runs call it after every operation they care about."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import RadixCache


def check_radix_integrity(cache: "RadixCache") -> None:
    def check(cond: bool, msg: str) -> None:
        if not cond:  # explicit raise: still checked under python -O
            raise AssertionError(f"radix cache integrity: {msg}")

    root = cache.root
    check(not root.key and root.lock_ref == 1 and root.parent is None, "bad root")
    sizes = {"evictable": 0, "protected": 0, "draft_evictable": 0, "draft_protected": 0}
    values, drafts, leaves = [], [], set()
    for node in cache.nodes():
        n = len(node.key)
        check(n > 0 and node.value.dtype == torch.int64 and node.value.shape == (n,),
              f"node {node.id}: key of {n} tokens, value of shape {tuple(node.value.shape)}")
        check(node.parent is not None and node.parent.children.get(node.key[0]) is node,
              f"node {node.id} is not its parent's child under its first token")
        expect = node.handle_locks + sum(c.lock_ref for c in node.children.values())
        check(node.lock_ref == expect and node.handle_locks >= 0,
              f"node {node.id}: lock_ref {node.lock_ref} != own {node.handle_locks} + "
              f"children's {expect - node.handle_locks}")
        check(node.last_access_time <= cache._clock, f"node {node.id}: access time ahead")
        kind = "protected" if node.lock_ref > 0 else "evictable"
        sizes[kind] += n
        values.append(node.value)
        if node.draft_value is not None:
            check(cache.draft_allocator is not None, "draft slots without a draft allocator")
            check(node.draft_value.dtype == torch.int64 and node.draft_value.shape == (n,),
                  f"node {node.id}: draft value shape {tuple(node.draft_value.shape)} "
                  f"for {n} tokens")
            check(node.parent is root or node.parent.draft_value is not None,
                  f"node {node.id} has draft slots but its parent has none")
            sizes["draft_" + kind] += n
            drafts.append(node.draft_value)
        if not node.children and node.lock_ref == 0:
            leaves.add(node)
    counted = {"evictable": cache._evictable, "protected": cache._protected,
               "draft_evictable": cache._draft_evictable,
               "draft_protected": cache._draft_protected}
    check(sizes == counted, f"counters {counted} != recount {sizes}")
    check(leaves == cache._evictable_leaves,
          f"{len(cache._evictable_leaves)} evictable leaves tracked, {len(leaves)} found")
    for name, parts, alloc in (("target", values, cache.allocator),
                               ("draft", drafts, cache.draft_allocator)):
        if not parts:
            continue
        slots = torch.cat(parts)
        check(int(slots.unique().numel()) == int(slots.numel()),
              f"a {name} slot appears twice in the tree")
        check(int(slots.min()) >= 1 and int(slots.max()) <= alloc.size,
              f"a {name} slot is outside 1..{alloc.size}")
        free = alloc.free_slots()
        check(not bool(torch.isin(slots, free).any()),
              f"a {name} slot held by the tree is free in the allocator")
