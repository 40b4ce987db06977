"""Per-request draft-context state and the small helpers of long-context drafting.

`DraftContext` is what `draft_kv.DraftKV` keeps per request (see its module docstring for
the view layout and invariants); `QueryRecorder` captures the draft's queries for
retrieval scoring; `SummaryCache` keeps chunk key summaries of warmed documents.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.base import AttentionBackend


def _empty(dtype=torch.int64) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype)


@dataclasses.dataclass
class Piece:
    """Tokens [start, start + n) of one catch-up forward, their new slots and positions."""

    start: int
    n: int
    slots: torch.Tensor  # [n] int64 draft slots (owned by the request)
    positions: torch.Tensor  # [n] int64 draft positions


@dataclasses.dataclass
class ChunkJob:
    """A retrieved chunk whose draft KV must be (re)computed over the sinks."""

    chunk: int
    tokens: List[int]  # [chunk_size]
    slots: torch.Tensor  # [chunk_size]
    positions: torch.Tensor  # [chunk_size]


@dataclasses.dataclass
class DraftContext:
    """One request's draft KV: which tokens have draft KV, in which slots, at which draft
    positions, and who owns them (the layout is in draft_kv.py's docstring)."""

    row: torch.Tensor  # [max_context] the drafter's req_to_token row: prefix slots
    computed: int = 0  # tokens of fill_ids the draft has processed (KV made, maybe dropped)
    prefix_len: int = 0  # row[:prefix_len] resident, at true positions
    protected: int = 0  # row[:protected] belong to the radix cache
    split: bool = False  # window mode: the prefix is the sinks, recent tokens in `window`
    window_start: int = 0
    window: torch.Tensor = dataclasses.field(default_factory=_empty)  # [computed - window_start]
    window_owned: torch.Tensor = dataclasses.field(default_factory=lambda: _empty(torch.bool))
    base: int = 0  # window token t sits at draft position t - base
    chunks: Dict[int, Tuple[torch.Tensor, int]] = dataclasses.field(default_factory=dict)
    summaries: Optional[torch.Tensor] = None  # [capacity, layers, kv_heads, head_dim]
    num_summaries: int = 0  # chunks [0, num_summaries) have a summary
    chain: List[int] = dataclasses.field(default_factory=list)  # chained chunk-token hashes
    query: Optional[torch.Tensor] = None  # [layers, kv_heads, head_dim] last query, grouped
    steps_since_refresh: int = 0
    need_refresh: bool = True


class QueryRecorder(AttentionBackend):
    """Wraps the draft's backend; keeps the queries of chosen token rows per layer, so
    retrieval can score chunks against what the draft is looking for right now."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.rows: Optional[torch.Tensor] = None  # [n] token rows to record, or None
        self._captured: List[torch.Tensor] = []

    def init_forward_metadata(self, forward_batch) -> None:
        self._captured = []
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.rows is not None:
            q_rows = q.reshape(-1, layer.num_heads, layer.head_dim)[self.rows]
            self._captured.append(q_rows.float())  # [n, heads, head_dim]
        return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache)

    def __getattr__(self, name: str):
        # Anything else a backend offers (e.g. the triton backend's kernels) is the inner's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def take(self) -> Optional[torch.Tensor]:
        """[n, layers, heads, head_dim] queries of the recorded rows, then forget them."""
        out = torch.stack(self._captured, 1) if self._captured else None
        self._captured, self.rows = [], None
        return out


class SummaryCache:
    """LRU map: chained hash of a document's chunks -> that chunk's key summary, so a
    second request on a warmed document skips re-reading it (retrieval only)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: "collections.OrderedDict[int, torch.Tensor]" = collections.OrderedDict()

    def get(self, key: int) -> Optional[torch.Tensor]:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: int, value: torch.Tensor) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)
