"""Memory pools: the request-to-token table, KV slot allocators and KV pools.

`ReqToTokenPool.req_to_token[row, pos]` is the KV slot of a request's token `pos`.
A `KVPool` holds per-layer K and V buffers indexed by slot; slot 0 is never handed out
(it is a padding target), so a pool of `size` usable slots has `size + 1` rows.
Invariant: with no request running and the cache flushed, every slot is free.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class ReqToTokenPool:
    """Fixed table of rows, one per running request; a row maps positions to KV slots."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free_rows: List[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.size, f"row {row} out of range"
        assert row not in self._free_rows, f"double free of req_to_token row {row}"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(slots)] = slots

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class TokenSlotAllocator:
    """Hands out KV slot indices 1..size (slot 0 is the padding slot).

    Free slots are kept in a tensor stack so alloc/free of many slots costs one slice. The
    stack holds slots in descending order and alloc returns them ascending, so successive
    allocations of one request (prefill chunks, then decode tokens, a chain's accepted
    drafts) form one ascending run that attention reads as a view instead of a gather;
    freed slots are pushed so that reusing them keeps that order.
    """

    def __init__(self, size: int, device: str = "cpu") -> None:
        self.size = size
        self.device = device
        # on a GPU, frees are checked without a host read each (see check())
        self.defer_checks = torch.device(device).type != "cpu"
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(self.size, 0, -1, dtype=torch.int64, device=self.device)
        self._num_free = self.size
        # is_free[slot]: catches double frees and frees of foreign slots at the source.
        self._is_free = torch.ones(self.size + 1, dtype=torch.bool, device=self.device)
        self._is_free[0] = False
        self._bad = torch.zeros((), dtype=torch.bool, device=self.device)

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self._num_free:
            return None
        self._num_free -= n
        out = self._free[self._num_free : self._num_free + n].flip(0)  # flip copies
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.reshape(-1)
        n = int(slots.numel())
        if n == 0:
            return
        if not self.defer_checks:
            assert int(slots.min()) >= 1 and int(slots.max()) <= self.size, (
                "freeing a slot out of range")
            assert not bool(self._is_free[slots].any()), "double free of a KV slot"
            index = slots
        else:  # the same checks, kept on the device until check() reads them
            index = slots.clamp(0, self.size)  # a bad slot must not fault the device
            self._bad |= ((slots < 1) | (slots > self.size)).any() | self._is_free[index].any()
        end = self._num_free + n
        assert end <= self.size, "freeing more KV slots than were allocated"
        self._free[self._num_free : end] = slots.flip(0)
        self._is_free[index] = True
        self._num_free = end

    def check(self) -> None:
        """The frees' range and double-free checks on a GPU (on the host they ran at once)."""
        assert not bool(self._bad), "a freed KV slot was out of range or already free"

    def free_slots(self) -> torch.Tensor:
        """The currently free slots (for integrity checks in tests)."""
        return self._free[: self._num_free].clone()


class KVPool:
    """Per-layer K/V buffers of shape [size + 1, num_kv_heads, head_dim]."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        v_head_dim: Optional[int] = None,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = device
        # torch.empty: on CPU the pages of a large pool are only committed when a slot is
        # first written, so a generous pool costs nothing until used. Slots are always
        # written before they are read; slot 0 (padding) is zeroed.
        self.k_buffer = [
            torch.empty((size + 1, num_kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.empty((size + 1, num_kv_heads, self.v_head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        for buf in self.k_buffer + self.v_buffer:
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: Optional[int] = None) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elem

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def get_kv(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of slots `src` to slots `dst` in every layer (tree compaction)."""
        for layer in range(self.num_layers):
            self.k_buffer[layer][dst] = self.k_buffer[layer][src]
            self.v_buffer[layer][dst] = self.v_buffer[layer][src]
