"""Prefix caches (RadixCache, ChunkCache) over a real TokenSlotAllocator.

Every scenario ends with the invariant the engine relies on: integrity holds, and once the
cache is reset every slot is free again (nothing leaks, nothing is freed twice).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from sglang.srt.mem_cache.base_prefix_cache import CacheHandle, create_prefix_cache
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache


def make(size: int = 64, draft_size: Optional[int] = None, policy: str = "lru"):
    alloc = TokenSlotAllocator(size)
    draft = TokenSlotAllocator(draft_size) if draft_size else None
    return RadixCache(alloc, draft, eviction_policy=policy), alloc, draft


def put(cache: RadixCache, alloc: TokenSlotAllocator, key: List[int], draft=False) -> int:
    """Insert `key` with fresh slots the way a caller must: free its duplicates."""
    slots = alloc.alloc(len(key))
    dslots = cache.draft_allocator.alloc(len(key)) if draft else None
    n = cache.insert(key, slots, dslots)
    alloc.free(slots[:n])
    cache.check_integrity()
    return n


def assert_all_free_after_reset(cache, alloc, draft=None) -> None:
    cache.check_integrity()
    cache.reset()
    cache.check_integrity()
    assert cache.total_size() == 0 and cache.draft_total_size() == 0
    assert alloc.available_size() == alloc.size
    if draft is not None:
        assert draft.available_size() == draft.size


# ----------------------------------------------------------------------------- match / insert
def test_upstream_cached_tokens_contract():
    cache, alloc, _ = make(size=30000)
    assert put(cache, alloc, list(range(100))) == 0
    assert cache.match_prefix(list(range(10000))).length == 100
    assert put(cache, alloc, list(range(10000))) == 100
    assert cache.match_prefix(list(range(9999))).length == 9999
    assert cache.match_prefix(list(range(1000))).length == 1000
    assert cache.match_prefix(list(range(11000))).length == 10000
    assert cache.total_size() == 10000
    assert_all_free_after_reset(cache, alloc)


def test_match_returns_inserted_slots_and_splits_on_partial_match():
    cache, alloc, _ = make()
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert len(list(cache.nodes())) == 1
    m = cache.match_prefix([1, 2, 3, 9, 9])
    assert m.length == 3 and m.handle.length == 3
    assert torch.equal(m.indices, slots[:3]) and m.indices.dtype == torch.int64
    assert len(list(cache.nodes())) == 2  # [1,2,3] -> [4,5]
    cache.check_integrity()
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).indices, slots)
    assert cache.match_prefix([2, 3]).length == 0
    empty = cache.match_prefix([])
    assert empty.length == 0 and empty.indices.numel() == 0
    assert_all_free_after_reset(cache, alloc)


def test_insert_reports_present_prefix_and_branches():
    cache, alloc, _ = make()
    assert put(cache, alloc, [1, 2, 3, 4]) == 0
    assert put(cache, alloc, [1, 2, 3, 4]) == 4
    assert put(cache, alloc, [1, 2, 7, 8, 9]) == 2  # splits [1,2,3,4] at 2
    assert put(cache, alloc, [5]) == 0
    assert cache.total_size() == 4 + 3 + 1
    assert alloc.available_size() == alloc.size - cache.total_size()
    assert cache.match_prefix([1, 2, 7, 8]).length == 4
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 4
    assert cache.match_prefix(torch.tensor([1, 2, 7])).length == 3  # tensor keys work too
    with pytest.raises(ValueError):
        cache.insert([1, 2], torch.tensor([1, 2, 3]))
    assert_all_free_after_reset(cache, alloc)


def test_long_key_match_is_fast():
    cache, alloc, _ = make(size=20000)
    key = list(range(10000))
    put(cache, alloc, key)
    other = list(key)
    other[9990] = -1
    start = time.perf_counter()
    for _ in range(20):
        assert cache.match_prefix(key).length == 10000
    assert cache.match_prefix(other).length == 9990
    assert (time.perf_counter() - start) / 21 < 0.05  # ~1 ms expected; generous on a busy box
    assert_all_free_after_reset(cache, alloc)


# ----------------------------------------------------------------------------- lock / evict
def test_lock_protects_from_eviction_and_unlock_releases():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    h = cache.match_prefix([1, 2, 3]).handle
    cache.lock(h)
    cache.lock(h)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.check_integrity()
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).length == 3 and cache.match_prefix([4]).length == 0
    cache.unlock(h)
    assert cache.evict(100) == 0  # still locked once
    cache.unlock(h)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    with pytest.raises(AssertionError, match="not locked"):
        cache.unlock(h)
    assert cache.evict(100) == 3 and alloc.available_size() == alloc.size
    with pytest.raises(AssertionError, match="evicted"):
        cache.lock(h)
    assert_all_free_after_reset(cache, alloc)


def test_lock_on_a_split_node_still_protects_the_whole_prefix():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3, 4])
    h = cache.match_prefix([1, 2, 3, 4]).handle
    cache.lock(h)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    cache.check_integrity()
    assert cache.protected_size() == 4 and cache.evict(100) == 0
    cache.unlock(h)
    cache.check_integrity()
    assert cache.evict(100) == 4
    assert_all_free_after_reset(cache, alloc)


def test_lru_evicts_least_recently_used_leaf_first():
    cache, alloc, _ = make()
    for first in (10, 20, 30):
        put(cache, alloc, [first, first + 1])
    cache.match_prefix([10, 11])  # touch 10: now 20 is the oldest
    assert cache.evict(1) == 2
    assert sorted(cache.root.children) == [10, 30]
    cache.match_prefix([30, 31])
    assert cache.evict(1) == 2 and sorted(cache.root.children) == [30]
    assert_all_free_after_reset(cache, alloc)


def test_lru_evicts_a_split_off_tail_that_was_not_touched():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [5, 6])
    cache.match_prefix([1, 2])  # splits: [1, 2] touched, [3] keeps its old time
    cache.match_prefix([5, 6])
    assert cache.evict(1) == 1 and cache.match_prefix([1, 2, 3]).length == 2
    assert_all_free_after_reset(cache, alloc)


@pytest.mark.parametrize("policy,survivor",
                         [("lru", 20), ("fifo", 30), ("mru", 30), ("lfu", 10), ("filo", 10)])
def test_eviction_policies(policy, survivor):
    cache, alloc, _ = make(policy=policy)
    for first in (10, 20, 30):  # created in this order
        put(cache, alloc, [first])
    for _ in range(2):
        cache.match_prefix([10])  # 10: two hits
    cache.match_prefix([20])  # 20: one hit, most recent
    assert cache.evict(2) == 2
    assert list(cache.root.children) == [survivor]
    assert_all_free_after_reset(cache, alloc)


def test_unknown_eviction_policy_is_rejected():
    with pytest.raises(ValueError, match="radix-eviction-policy"):
        RadixCache(TokenSlotAllocator(4), eviction_policy="random")


def test_evict_frees_to_allocator_and_parent_becomes_leaf():
    cache, alloc, _ = make(size=16)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5])
    assert alloc.available_size() == 11
    assert cache.evict(1) == 2  # the leaf [4, 5]
    assert alloc.available_size() == 13 and cache.match_prefix([1, 2, 3, 4]).length == 3
    cache.check_integrity()
    assert cache.evict(1) == 3  # the parent became an evictable leaf
    assert alloc.available_size() == 16 and cache.total_size() == 0
    assert cache.evict(5) == 0
    cache.check_integrity()


# ----------------------------------------------------------------------------- life cycle
@dataclass
class Req:
    key: List[int]
    slots: torch.Tensor
    handle: CacheHandle


def admit(cache, alloc, key: List[int]) -> Req:
    m = cache.match_prefix(key)
    cache.lock(m.handle)
    return Req(key, torch.cat([m.indices, alloc.alloc(len(key) - m.length)]), m.handle)


def test_two_requests_sharing_a_prefix_free_duplicates():
    cache, alloc, _ = make(size=64)
    doc = list(range(100, 120))
    a = admit(cache, alloc, doc + [1, 2])
    b = admit(cache, alloc, doc + [3])  # admitted before `a` shared anything: computes all
    assert alloc.available_size() == 64 - 22 - 21
    # a's prompt is prefilled: share it while a decodes on
    indices, a.handle = cache.cache_unfinished(a.key, a.slots, a.handle)
    assert torch.equal(indices, a.slots) and a.handle.length == 22
    assert cache.protected_size() == 22 and cache.evictable_size() == 0
    cache.check_integrity()
    # b finishes: its 20 document slots duplicate a's and are freed, its tail is kept
    cache.cache_finished(b.key, b.slots, b.handle)
    cache.check_integrity()
    assert cache.total_size() == 23 and alloc.available_size() == 64 - 23
    assert cache.evictable_size() == 1  # b's [3]; the document is locked by a
    # a decodes one more token, then finishes
    a.key.append(4)
    a.slots = torch.cat([indices, alloc.alloc(1)])
    cache.cache_finished(a.key, a.slots, a.handle)
    cache.check_integrity()
    assert cache.protected_size() == 0 and cache.total_size() == 24
    assert alloc.available_size() + cache.total_size() == 64
    # a third request hits the whole document
    c = admit(cache, alloc, doc + [3, 5])
    assert c.handle.length == 21 and torch.equal(c.slots[:21], cache.match_prefix(doc + [3]).indices)
    cache.cache_finished(c.key, c.slots, c.handle)
    assert_all_free_after_reset(cache, alloc)


def test_cache_unfinished_twice_chunked_prefill_and_canonical_indices():
    cache, alloc, _ = make(size=64)
    other = admit(cache, alloc, [1, 2, 3, 4, 5, 6])
    cache.cache_finished(other.key, other.slots, other.handle)
    r = admit(cache, alloc, [1, 2])  # matched [1, 2] only
    r.slots = torch.cat([r.slots, alloc.alloc(2)])  # chunk 2: [3, 4] recomputed
    r.key = [1, 2, 3, 4]
    indices, r.handle = cache.cache_unfinished(r.key, r.slots, r.handle)
    assert torch.equal(indices, cache.match_prefix([1, 2, 3, 4]).indices)
    assert alloc.available_size() + cache.total_size() == 64  # r's [3,4] copies were freed
    r.key += [9, 9]
    r.slots = torch.cat([indices, alloc.alloc(2)])
    indices, r.handle = cache.cache_unfinished(r.key, r.slots, r.handle)
    assert r.handle.length == 6 and cache.protected_size() == 6
    cache.check_integrity()
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.cache_finished(r.key, indices, r.handle)
    assert_all_free_after_reset(cache, alloc)


def test_cache_finished_rejects_slots_that_differ_from_the_locked_prefix():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    r = admit(cache, alloc, [1, 2, 3, 4])
    bad = r.slots.clone()
    bad[0] = int(alloc.alloc(1)[0])
    with pytest.raises(AssertionError, match="locked prefix"):
        cache.cache_finished(r.key, bad, r.handle)


def test_check_integrity_detects_corruption():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    node = next(iter(cache.nodes()))
    alloc.free(node.value[:1])  # a tree slot is now also free
    with pytest.raises(AssertionError, match="free in the allocator"):
        cache.check_integrity()
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="counters"):
        cache.check_integrity()
    cache, alloc, _ = make()
    put(cache, alloc, [1])
    put(cache, alloc, [4])
    a, b = cache.nodes()
    b.value = a.value[:1].clone()
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    next(iter(cache.nodes())).lock_ref = 2
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity()


# ----------------------------------------------------------------------------- ChunkCache
def test_chunk_cache_shares_nothing_and_frees_everything():
    alloc, draft = TokenSlotAllocator(16), TokenSlotAllocator(16)
    cache = create_prefix_cache(True, alloc, draft)
    assert isinstance(cache, ChunkCache)
    assert isinstance(create_prefix_cache(False, alloc), RadixCache)
    slots, dslots = alloc.alloc(5), draft.alloc(4)
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.indices.numel() == 0 and m.draft_length == 0
    cache.lock(m.handle)
    indices, handle = cache.cache_unfinished([1, 2, 3, 4, 5], slots, m.handle, dslots)
    assert torch.equal(indices, slots) and cache.draft_indices(handle).numel() == 0
    assert alloc.available_size() == 11 and draft.available_size() == 12  # still the request's
    cache.cache_finished([1, 2, 3, 4, 5], slots, handle, dslots)
    assert alloc.available_size() == 16 and draft.available_size() == 16
    assert cache.insert([1, 2], alloc.alloc(2)) == 0 and alloc.available_size() == 16
    assert cache.match_prefix([1, 2]).length == 0
    assert cache.evict(10) == 0 and cache.total_size() == 0
    cache.check_integrity()
    cache.reset()


# ----------------------------------------------------------------------------- draft slots
def test_match_reports_the_draft_prefix():
    cache, alloc, draft = make(draft_size=64)
    put(cache, alloc, [1, 2, 3, 4], draft=True)
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # no drafts for [5, 6]
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.length == 6 and m.draft_length == 4 and len(m.draft_indices) == 4
    assert cache.draft_indices(m.handle).tolist() == m.draft_indices.tolist()
    m2 = cache.match_prefix([1, 2, 9])  # split keeps the drafts of both halves
    assert m2.draft_length == 2 and torch.equal(m2.draft_indices, m.draft_indices[:2])
    assert cache.draft_total_size() == 4 and draft.available_size() == 60
    assert_all_free_after_reset(cache, alloc, draft)


def test_insert_with_shorter_draft_splits_and_adopts():
    cache, alloc, draft = make(draft_size=64)
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # target only
    slots, dslots = alloc.alloc(6), draft.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots, dslots) == 6  # adopts drafts for [1,2,3]
    alloc.free(slots)
    cache.check_integrity()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.draft_length == 3 and torch.equal(m.draft_indices, dslots)
    # a duplicate draft is freed by the cache; a tail with partial drafts is split
    slots, dslots = alloc.alloc(8), draft.alloc(7)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], slots, dslots) == 6
    alloc.free(slots[:6])
    cache.check_integrity()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.draft_length == 7 and torch.equal(m.draft_indices[3:], dslots[3:])
    assert draft.available_size() + cache.draft_total_size() == 64
    with pytest.raises(ValueError):
        cache.insert([1], torch.tensor([1]), torch.tensor([1, 2]))
    assert_all_free_after_reset(cache, alloc, draft)


def test_evict_draft_drops_drafts_before_nodes_deepest_and_lru_first():
    cache, alloc, draft = make(draft_size=64)
    put(cache, alloc, [1, 2], draft=True)
    put(cache, alloc, [1, 2, 3], draft=True)
    put(cache, alloc, [7, 8], draft=True)
    h = cache.match_prefix([7, 8]).handle
    cache.lock(h)
    assert cache.evict_draft(1) == 1  # [3]: the only unlocked draft leaf, deepest first
    cache.check_integrity()
    assert cache.match_prefix([1, 2, 3]).draft_length == 2
    assert cache.total_size() == 5  # target nodes all kept
    assert cache.evict_draft(10) == 2  # then [1, 2]; [7, 8] is locked
    assert cache.draft_total_size() == 2 and draft.available_size() == 62
    cache.unlock(h)
    assert cache.evict(100) == 5 and draft.available_size() == 64  # evict frees drafts too
    assert_all_free_after_reset(cache, alloc, draft)


def test_life_cycle_with_draft_slots():
    cache, alloc, draft = make(size=32, draft_size=32)
    put(cache, alloc, [1, 2, 3], draft=True)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.handle)
    slots = torch.cat([m.indices, alloc.alloc(2)])
    dslots = torch.cat([m.draft_indices, draft.alloc(1)])  # the draft lags one token
    indices, h = cache.cache_unfinished([1, 2, 3, 4, 5], slots, m.handle, dslots)
    assert torch.equal(cache.draft_indices(h), dslots)
    cache.check_integrity()
    # another request brings drafts for all five tokens: only its new ones are kept
    other = draft.alloc(5)
    n = cache.insert([1, 2, 3, 4, 5], indices.clone(), other)  # target: all tree-owned
    assert n == 5 and len(cache.draft_indices(h)) == 5
    cache.check_integrity()
    assert draft.available_size() + cache.draft_total_size() == 32
    cache.cache_finished([1, 2, 3, 4, 5], indices, h, cache.draft_indices(h))
    assert_all_free_after_reset(cache, alloc, draft)


def test_integrity_covers_drafts():
    cache, alloc, draft = make(draft_size=16)
    put(cache, alloc, [1, 2], draft=True)
    put(cache, alloc, [1, 2, 3], draft=True)
    top, leaf = cache.nodes()
    draft.free(top.draft_value)
    with pytest.raises(AssertionError, match="draft slot held by the tree is free"):
        cache.check_integrity()
    draft.alloc(2)
    cache.check_integrity()
    cache._set_draft(top, None)  # leaves a gap below: drafts must be prefix-closed
    with pytest.raises(AssertionError, match="parent has none"):
        cache.check_integrity()


# ----------------------------------------------------------------------------- randomized
def test_randomized_operations_conserve_slots():
    rng = random.Random(1234)
    size = dsize = 300
    cache, alloc, draft = make(size=size, draft_size=dsize)
    reqs: List[dict] = []

    def alloc_with_evict(n: int):
        if alloc.available_size() < n:
            cache.evict(n - alloc.available_size())
        return alloc.alloc(n)

    def alloc_draft(n: int):
        if draft.available_size() < n:
            cache.evict_draft(n - draft.available_size())
        return draft.alloc(n)

    def random_key() -> List[int]:
        base = rng.choice(reqs)["key"] if reqs and rng.random() < 0.5 else []
        base = base[: rng.randint(0, len(base))]
        return base + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]

    def conserve() -> None:
        cache.check_integrity()
        owned = sum(len(r["slots"]) - r["handle"].length for r in reqs)
        assert alloc.available_size() + cache.total_size() + owned == size
        downed = sum(len(r["draft"]) - r["dtree"] for r in reqs)
        assert draft.available_size() + cache.draft_total_size() + downed == dsize

    for _ in range(400):
        op = rng.choice(["start", "start", "grow", "finish", "match", "insert", "evict",
                         "evict_draft", "lock"])
        if op == "start" and len(reqs) < 6:
            key = random_key()
            m = cache.match_prefix(key)
            cache.lock(m.handle)
            new = alloc_with_evict(len(key) - m.length)
            if new is None:
                cache.unlock(m.handle)
                continue
            dnew = alloc_draft(rng.randint(0, len(key) - m.draft_length))
            dnew = dnew if dnew is not None else draft.alloc(0)
            reqs.append({"key": key, "slots": torch.cat([m.indices, new]), "handle": m.handle,
                         "draft": torch.cat([m.draft_indices, dnew]), "dtree": m.draft_length})
        elif op == "grow" and reqs:
            r = rng.choice(reqs)
            extra = [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
            new = alloc_with_evict(len(extra))
            if new is None:
                continue
            r["key"] = r["key"] + extra
            r["slots"] = torch.cat([r["slots"], new])
            indices, r["handle"] = cache.cache_unfinished(r["key"], r["slots"], r["handle"],
                                                          r["draft"])
            r["slots"] = indices
            r["draft"] = cache.draft_indices(r["handle"])
            r["dtree"] = len(r["draft"])
        elif op == "finish" and reqs:
            r = reqs.pop(rng.randrange(len(reqs)))
            cache.cache_finished(r["key"], r["slots"], r["handle"], r["draft"])
        elif op == "match":
            cache.match_prefix(random_key())
        elif op == "insert":
            key = random_key()
            slots = alloc_with_evict(len(key))
            if slots is not None:
                alloc.free(slots[: cache.insert(key, slots)])
        elif op == "evict":
            cache.evict(rng.randint(1, 20))
        elif op == "evict_draft":
            cache.evict_draft(rng.randint(1, 20))
        elif op == "lock" and reqs:
            h = rng.choice(reqs)["handle"]  # a second, short-lived lock on the same handle
            cache.lock(h)
            assert cache.evict(size) <= size
            conserve()
            cache.unlock(h)
        conserve()
    for r in reqs:
        cache.cache_finished(r["key"], r["slots"], r["handle"], r["draft"])
    assert_all_free_after_reset(cache, alloc, draft)
