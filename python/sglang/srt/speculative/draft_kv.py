"""Which context the draft model reads (long-context drafting): full | streaming | retrieval.

Per request, a `DraftContext` says which draft KV slots are resident and at which draft
positions; the drafter hands `view(ctx)` (a list of slots, no KV copied) to the attention
backend as `ForwardBatch.kv_indices`. Layout of a view, in draft-position order:

    prefix   row[:prefix_len]  true positions, computed over the full causal context
    chunks   retrieved chunks (retrieval only), recomputed when they enter the view
    window   the most recent tokens [window_start, computed), draft position t - base

Invariants:
- owned draft slots of a request (prefix past `protected`, window, chunks) <= budget, plus
  the catch-up piece in flight (which counts against the window) and the tree;
- with a bounded policy, every draft position stays below `max_position` (tree included):
  when the next piece would not fit, `_rebase` rewinds the window and recomputes it at
  positions right after the sinks and the chunk region (docs/long_context_drafting.md);
- row[:protected] belongs to the radix cache (adopted or handed over): never freed here;
- only the prefix (true positions, full context) is ever shared through the radix cache.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from sglang.srt.speculative.draft_kv_retrieval import ChunkRetrievalMixin
from sglang.srt.speculative.draft_kv_state import DraftContext, Piece, SummaryCache, _empty

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVPool, TokenSlotAllocator

POLICIES = ("full", "streaming", "retrieval")
DEFAULT_BUDGET = 2048  # resident draft tokens per request when a bounded policy has no budget


@dataclasses.dataclass(frozen=True)
class DraftKVConfig:
    policy: str
    budget: int  # resident draft tokens per request, tree excluded (0 = unbounded: full)
    sink: int
    chunk_size: int
    refresh_interval: int
    max_position: int  # bounded policies keep every draft position below this
    tree_depth: int  # positions the tree uses beyond the root
    piece: int  # most tokens one catch-up forward adds per request (window mode)

    @property
    def bounded(self) -> bool:
        return self.policy != "full"

    @property
    def num_chunks(self) -> int:
        """Retrieved chunks in a view: half of what the sinks leave, in whole chunks."""
        if self.policy != "retrieval":
            return 0
        return (self.budget - self.sink) // 2 // self.chunk_size

    @property
    def retrieved(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def window(self) -> int:
        return self.budget - self.sink - self.retrieved

    @classmethod
    def from_server_args(cls, args, draft_max_position: int, tree_depth: int,
                         prefill_chunk: int) -> "DraftKVConfig":
        policy = args.speculative_draft_kv_policy
        max_pos = args.speculative_draft_max_position or draft_max_position
        budget = 0 if policy == "full" else (args.speculative_draft_kv_budget or DEFAULT_BUDGET)
        cfg = cls(policy, budget, args.speculative_draft_kv_sink,
                  args.speculative_draft_kv_chunk_size,
                  args.speculative_draft_kv_refresh_interval, max_pos, tree_depth, 1)
        piece = max(1, prefill_chunk) if policy == "full" else max(1, min(prefill_chunk,
                                                                          cfg.window // 2))
        cfg = dataclasses.replace(cfg, piece=piece)
        if cfg.bounded and cfg.window < 4:
            raise ValueError(f"--speculative-draft-kv-budget {budget} leaves a recent window of "
                             f"{cfg.window} tokens; raise it or lower --speculative-draft-kv-sink")
        # A rebase must leave room for many tokens before the next one (amortized cost).
        if cfg.bounded and 2 * (budget + tree_depth + 1) > max_pos:
            raise ValueError(
                f"--speculative-draft-kv-budget {budget} plus the tree ({tree_depth} levels) must "
                f"be at most half the draft's position range ({max_pos}); lower the budget or "
                "raise --speculative-draft-max-position")
        return cfg


class DraftKV(ChunkRetrievalMixin):
    """The policy engine: decides which draft slots each request keeps, frees the rest,
    and where a token's draft KV sits in draft positions. It never runs the model: the
    drafter runs the forwards it asks for (pieces, chunk jobs) and commits them back.
    Which chunks a retrieval view holds is `ChunkRetrievalMixin`'s (draft_kv_retrieval.py)."""

    def __init__(self, cfg: DraftKVConfig, allocator: "TokenSlotAllocator", kv_pool: "KVPool",
                 num_layers: int, summary_capacity: int) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.num_layers = num_layers
        self.summary_cache = SummaryCache(summary_capacity)

    # ------------------------------------------------------------------ life cycle
    def adopt(self, ctx: DraftContext, slots: torch.Tensor) -> int:
        """A fresh request starts from draft slots the radix cache holds for its prefix
        (valid while the request's handle is locked). Returns how many it took."""
        assert ctx.computed == 0, "adopt: the request already has draft KV"
        d = len(slots) if not self.cfg.bounded else min(len(slots), self.cfg.sink + self.cfg.window)
        ctx.row[:d] = slots[:d]
        ctx.computed = ctx.prefix_len = ctx.protected = d
        return d

    def shareable(self, ctx: DraftContext, limit: int) -> torch.Tensor:
        """Slots of the prefix [0, n), n <= limit, that the radix cache may take: true
        positions, full causal context (the only draft KV that is the same for everyone)."""
        return ctx.row[: min(ctx.prefix_len, limit)].clone()

    def on_cached(self, ctx: DraftContext, canonical: torch.Tensor, passed: int) -> None:
        """After cache_unfinished: the cache owns the first `passed` prefix positions and
        may hold other slots than ours for them (it freed our duplicates)."""
        m = min(passed, len(canonical), ctx.prefix_len)
        ctx.row[:m] = canonical[:m]
        ctx.protected = max(ctx.protected, m)

    def release(self, ctx: DraftContext, keep: int) -> torch.Tensor:
        """Free everything the request owns except prefix [0, keep), returned for the cache
        (whose ownership passes to it)."""
        keep = min(keep, ctx.prefix_len)
        self._free(ctx.row[max(keep, ctx.protected): ctx.prefix_len])
        self._free(ctx.window[ctx.window_owned])
        for slots, _ in ctx.chunks.values():
            self._free(slots)
        out = ctx.row[:keep].clone()
        ctx.prefix_len = ctx.computed = 0
        ctx.window, ctx.window_owned, ctx.chunks = _empty(), _empty(torch.bool), {}
        return out

    def truncate(self, ctx: DraftContext, upto: int) -> None:
        """Forget draft KV at and after token `upto` (the next catch-up recomputes it)."""
        if ctx.computed <= upto:
            return
        if not ctx.split:
            self._free(ctx.row[max(upto, ctx.protected): ctx.prefix_len])
            ctx.prefix_len = ctx.computed = upto
            ctx.protected = min(ctx.protected, upto)
            return
        k = max(0, upto - ctx.window_start)
        self._free(ctx.window[k:][ctx.window_owned[k:]])
        ctx.window, ctx.window_owned = ctx.window[:k], ctx.window_owned[:k]
        ctx.computed = upto
        ctx.window_start = min(ctx.window_start, upto)

    def resident(self, ctx: DraftContext) -> int:
        """Draft slots this request owns (the radix cache's shared prefix excluded)."""
        own_prefix = max(0, ctx.prefix_len - ctx.protected)
        chunks = sum(len(s) for s, _ in ctx.chunks.values())
        return own_prefix + int(ctx.window_owned.sum()) + chunks

    def need(self, ctx: DraftContext, end: int) -> int:
        """An upper bound on how much a catch-up to `end` grows the request's usage (for
        reservations). Bounded policies free before they allocate, so usage never passes
        the budget."""
        if not self.cfg.bounded:
            return max(0, end - ctx.computed)
        return max(0, self.cfg.budget - self.resident(ctx))

    # ------------------------------------------------------------------ catch-up
    def next_piece(self, ctx: DraftContext, tokens: Sequence[int], end: int, limit: int
                   ) -> Optional[Piece]:
        """Prepare the next catch-up forward toward `end` (at most `limit` tokens): drop what
        leaves the view, jump or rebase when needed, allocate the piece's slots. The view
        for the forward is `view(ctx)` + the piece; `commit` after it."""
        cfg = self.cfg
        if ctx.computed >= end or limit <= 0:
            return None
        if not cfg.bounded or not ctx.split:
            # Prefix mode grows to sinks + window; a request that will outgrow it anyway
            # splits right after its sinks (what lies between would only be dropped).
            cap = cfg.sink + cfg.window if end <= cfg.sink + cfg.window else cfg.sink
            room = end - ctx.computed if not cfg.bounded else cap - ctx.computed
            if room > 0:
                n = min(end - ctx.computed, limit, room)
                return self._alloc_piece(ctx.computed, n, ctx.computed)
            self._split(ctx)
        self._maybe_jump(ctx, tokens, end)
        n = min(end - ctx.computed, limit, cfg.piece)
        if ctx.computed + n - 1 - ctx.base + cfg.tree_depth >= cfg.max_position:
            self._rebase(ctx)
            n = min(end - ctx.computed, limit, cfg.piece)
        self._trim(ctx, cfg.window - n)
        return self._alloc_piece(ctx.computed, n, ctx.computed - ctx.base)

    def commit(self, ctx: DraftContext, piece: Piece, tokens: Sequence[int]) -> None:
        """The piece's KV is written: it joins the prefix or the window."""
        assert piece.start == ctx.computed, "commit: pieces must be committed in order"
        if not ctx.split:
            ctx.row[piece.start: piece.start + piece.n] = piece.slots
            ctx.prefix_len = piece.start + piece.n
        else:
            ctx.window = torch.cat([ctx.window, piece.slots])
            ctx.window_owned = torch.cat([ctx.window_owned, torch.ones(piece.n, dtype=torch.bool)])
        ctx.computed = piece.start + piece.n
        if self.cfg.policy == "retrieval":
            self._summarize(ctx, tokens)

    def view(self, ctx: DraftContext) -> torch.Tensor:
        """[v] draft slots the draft attends to now, in draft-position order."""
        parts = [ctx.row[: ctx.prefix_len]]
        parts += [s for s, _ in sorted(ctx.chunks.values(), key=lambda c: c[1])]
        parts.append(ctx.window)
        return torch.cat(parts)

    def sinks(self, ctx: DraftContext) -> torch.Tensor:
        return ctx.row[: min(ctx.prefix_len, self.cfg.sink)]

    def root_position(self, ctx: DraftContext) -> int:
        """Draft position of the last processed token (the tree's root)."""
        return ctx.computed - 1 - (ctx.base if ctx.split else 0)

    def _alloc_piece(self, start: int, n: int, pos0: int) -> Piece:
        slots = self.allocator.alloc(n)
        assert slots is not None, "draft KV pool exhausted despite the reservation"
        return Piece(start, n, slots, torch.arange(pos0, pos0 + n, dtype=torch.int64))

    def _free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self.allocator.free(slots)

    def _split(self, ctx: DraftContext) -> None:
        """Prefix mode -> window mode: the prefix keeps the sinks, the window the last
        `window` tokens; the middle is dropped."""
        cfg = self.cfg
        start = max(cfg.sink, ctx.computed - cfg.window)
        ctx.window = ctx.row[start: ctx.computed].clone()
        ctx.window_owned = torch.arange(start, ctx.computed) >= ctx.protected
        self._free(ctx.row[max(cfg.sink, ctx.protected): start])
        ctx.prefix_len, ctx.window_start, ctx.split, ctx.base = cfg.sink, start, True, 0
        ctx.need_refresh = True

    def _trim(self, ctx: DraftContext, keep: int) -> None:
        excess = len(ctx.window) - max(keep, 0)
        if excess > 0:
            self._free(ctx.window[:excess][ctx.window_owned[:excess]])
            ctx.window, ctx.window_owned = ctx.window[excess:], ctx.window_owned[excess:]
            ctx.window_start += excess

    def _drop_window_and_chunks(self, ctx: DraftContext) -> None:
        self._free(ctx.window[ctx.window_owned])
        ctx.window, ctx.window_owned = _empty(), _empty(torch.bool)
        for slots, _ in ctx.chunks.values():
            self._free(slots)
        ctx.chunks = {}
        ctx.need_refresh = True

    def _maybe_jump(self, ctx: DraftContext, tokens: Sequence[int], end: int) -> None:
        """Skip tokens that would leave the window before the draft ever reads them.
        Retrieval may only skip whole chunks whose summaries the summary cache has."""
        target = end - self.cfg.window
        if self.cfg.policy == "retrieval":
            c = self.cfg.chunk_size
            target = target // c * c
            if target <= ctx.computed:
                return
            found = []
            for h in self._chain(ctx, tokens, target // c)[ctx.num_summaries: target // c]:
                found.append(self.summary_cache.get(h))
                if found[-1] is None:
                    return  # not warmed: read the document (summaries need its keys)
            for s in found:
                self._add_summary(ctx, s)
        if target <= ctx.computed:
            return
        self._free(ctx.window[ctx.window_owned])
        ctx.window, ctx.window_owned = _empty(), _empty(torch.bool)
        ctx.computed = ctx.window_start = target

    def _rebase(self, ctx: DraftContext) -> None:
        """Positions would leave the trained range: rewind the window and recompute it at
        positions right after the sinks and the chunk region (chunks are re-picked)."""
        cfg = self.cfg
        start = max(ctx.window_start, ctx.computed - (cfg.window - cfg.piece))
        self._drop_window_and_chunks(ctx)
        ctx.computed = ctx.window_start = start
        ctx.base = start - (cfg.sink + cfg.retrieved)

    def _resident_slots(self, ctx: DraftContext, a: int, b: int) -> torch.Tensor:
        """Slots of tokens [a, b), from the prefix and/or the window (all resident)."""
        head = ctx.row[a: min(b, ctx.prefix_len)]
        ws = ctx.window_start
        tail = ctx.window[max(a, ws) - ws: b - ws] if ctx.split and b > ws else _empty()
        assert len(head) + len(tail) == b - a, "a chunk left the view before it was summarized"
        return torch.cat([head, tail])
