"""ReqToTokenPool, TokenSlotAllocator and KVPool: alloc/free/clear and their guards."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator


def test_req_to_token_pool_alloc_write_free_clear():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None and pool.available_size() == 0
    pool.write(rows[1], 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[rows[1]].tolist() == [0, 0, 7, 8, 9, 0, 0, 0]
    pool.free(rows[1])
    assert pool.available_size() == 1 and pool.alloc() == rows[1]
    pool.clear()
    assert pool.available_size() == 3


def test_req_to_token_pool_double_free_asserts():
    pool = ReqToTokenPool(size=2, max_context_len=4)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(row)


def test_allocator_hands_out_slots_1_to_size_once():
    alloc = TokenSlotAllocator(10)
    assert alloc.available_size() == 10
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert a.dtype == torch.int64 and len(a) == 4 and len(b) == 6
    assert sorted(torch.cat([a, b]).tolist()) == list(range(1, 11))  # slot 0 is padding
    assert alloc.alloc(1) is None and alloc.available_size() == 0
    assert alloc.alloc(0).numel() == 0


def test_allocator_free_and_realloc_and_free_slots():
    alloc = TokenSlotAllocator(8)
    a = alloc.alloc(5)
    assert sorted(alloc.free_slots().tolist()) == sorted(set(range(1, 9)) - set(a.tolist()))
    alloc.free(a[:2])
    alloc.free(torch.empty(0, dtype=torch.int64))  # no-op
    assert alloc.available_size() == 5
    b = alloc.alloc(5)
    held = torch.cat([a[2:], b]).tolist()
    assert sorted(held) == list(range(1, 9))


def test_allocator_returned_slots_are_not_views_of_the_free_stack():
    alloc = TokenSlotAllocator(4)
    a = alloc.alloc(2)
    before = a.clone()
    alloc.free(torch.tensor([int(a[0])]))
    alloc.alloc(1)
    assert torch.equal(a, before)


def test_allocator_clear_and_overflow_assert():
    alloc = TokenSlotAllocator(4)
    alloc.alloc(3)
    alloc.clear()
    assert alloc.available_size() == 4
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([1]))  # all four are already free


def test_allocator_double_free_of_one_slot_asserts():
    alloc = TokenSlotAllocator(4)
    a = alloc.alloc(2)
    alloc.free(a[:1])
    with pytest.raises(AssertionError):
        alloc.free(a[:1])


def test_kv_pool_set_get_move_and_bytes():
    pool = KVPool(size=4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    assert pool.k_buffer[0].shape == (5, 1, 2)  # slot 0 is the padding row
    loc = torch.tensor([1, 3])
    k = torch.arange(4.0).view(2, 1, 2)
    pool.set_kv(1, loc, k, -k)
    kb, vb = pool.get_kv(1)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], -k)
    pool.move_kv(torch.tensor([3]), torch.tensor([2]))
    assert torch.equal(pool.get_kv(1)[0][2], k[1])
    assert KVPool.bytes_per_token(2, 1, 2, torch.float32) == 2 * 1 * (2 + 2) * 4
