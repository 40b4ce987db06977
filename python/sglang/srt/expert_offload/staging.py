"""The GPU slow tier's host side: a bounded set of pinned staging buffers.

Experts stay where the checkpoint keeps them (its memory-mapped safetensors: page cache or
disk). A load reads one expert into a pinned staging pair, then copies it to the GPU slot
asynchronously on the current stream (the store runs loads on its own stream). A pair is
written again only after its last copy finished (one event per pair), so pinned host memory
is `depth` experts, whatever the model's size: pinning every expert needed host RAM for the
whole MoE, the situation offloading is for.
"""

from __future__ import annotations

import queue
from typing import Dict, List, Optional, Tuple

import torch

# Staging pairs: one per loader thread and a copy in flight behind each (the store runs two
# loader threads), so a read never waits for a copy unless the GPU is the bottleneck.
DEFAULT_DEPTH = 4


class _Pair:
    """One staging pair: flat host buffers of the largest expert, and the event of its last
    host-to-device copy (None: copies are synchronous, the CPU case)."""

    def __init__(self, n13: int, n2: int, dtype: torch.dtype, pin: bool) -> None:
        self.w13 = torch.empty(n13, dtype=dtype, pin_memory=pin)
        self.w2 = torch.empty(n2, dtype=dtype, pin_memory=pin)
        self.event: Optional["torch.cuda.Event"] = None


class PinnedStagingSource:
    """An ExpertSource for device slots: `inner`'s experts through `depth` pinned pairs."""

    def __init__(self, inner, shapes: Dict[int, Tuple[torch.Size, torch.Size]],
                 dtype: torch.dtype, depth: int = DEFAULT_DEPTH,
                 pin: Optional[bool] = None) -> None:
        """`shapes`: layer -> (w13, w2) shape of one expert; `pin` defaults to whether CUDA
        is available (pinned memory needs it)."""
        if depth < 1:
            raise ValueError("the staging set needs at least one pair")
        pin = torch.cuda.is_available() if pin is None else pin
        n13 = max(s13.numel() for s13, _ in shapes.values())
        n2 = max(s2.numel() for _, s2 in shapes.values())
        self.inner = inner
        self._pairs: List[_Pair] = [_Pair(n13, n2, dtype, pin) for _ in range(depth)]
        self._free: "queue.Queue[_Pair]" = queue.Queue()
        for p in self._pairs:
            self._free.put(p)

    def staged_bytes(self) -> int:
        """Host memory the staging set holds (pinned where CUDA is present)."""
        return sum(p.w13.numel() * p.w13.element_size() + p.w2.numel() * p.w2.element_size()
                   for p in self._pairs)

    def read_into(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        pair = self._free.get()  # a pair no other loader thread is using
        try:
            if pair.event is not None:
                pair.event.synchronize()  # its previous copy has left the buffer
            h13 = pair.w13[: w13.numel()].view(w13.shape)
            h2 = pair.w2[: w2.numel()].view(w2.shape)
            n = self.inner.read_into(layer, expert, h13, h2)
            async_copy = w13.is_cuda
            w13.copy_(h13, non_blocking=async_copy)
            w2.copy_(h2, non_blocking=async_copy)
            if async_copy:
                pair.event = torch.cuda.Event()
                pair.event.record()  # on the current (the store's load) stream
            return n
        finally:
            self._free.put(pair)

    def close(self) -> None:
        for p in self._pairs:
            if p.event is not None:
                p.event.synchronize()
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
