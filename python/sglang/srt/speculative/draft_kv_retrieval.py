"""Which retrieved chunks a request's draft view holds (the retrieval policy of draft_kv.py).

Between the sinks and the recent window a retrieval view keeps `num_chunks` chunks of the
document, picked by the draft's latest query against each chunk's mean key (its summary)
and, first, by where the text being written was copied from (a longest-suffix match). The
methods read and write `DraftContext` and free through `DraftKV`'s allocator; `DraftKV`
inherits them, so a newcomer reads the view's layout there and the choice of chunks here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

import torch

from sglang.srt.speculative.draft_kv_state import ChunkJob, DraftContext

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVPool, TokenSlotAllocator
    from sglang.srt.speculative.draft_kv import DraftKVConfig
    from sglang.srt.speculative.draft_kv_state import SummaryCache

# Suffix lengths tried, longest first, when retrieval looks for the text being copied.
_LEXICAL_NGRAMS = (16, 8)


class ChunkRetrievalMixin:
    """Chunk choice and chunk summaries for `DraftKV`, which supplies the attributes below
    and the slot helpers `_free(slots)` and `_resident_slots(ctx, a, b)`."""

    cfg: "DraftKVConfig"
    allocator: "TokenSlotAllocator"
    kv_pool: "KVPool"
    num_layers: int
    summary_cache: "SummaryCache"

    def set_query(self, ctx: DraftContext, q: torch.Tensor) -> None:
        """q: [layers, heads, head_dim] the draft's latest query; summed per KV head group."""
        kv_heads = self.kv_pool.num_kv_heads
        ctx.query = q.view(q.shape[0], kv_heads, -1, q.shape[-1]).sum(2)

    def step_done(self, ctx: DraftContext) -> None:
        ctx.steps_since_refresh += 1

    def refresh_due(self, ctx: DraftContext, tokens: Sequence[int]) -> bool:
        """Every `refresh_interval` steps, and at once when the text starts copying from a
        chunk that is not in the view."""
        if not (self.cfg.policy == "retrieval" and ctx.split and ctx.query is not None):
            return False
        if ctx.need_refresh or ctx.steps_since_refresh >= self.cfg.refresh_interval:
            return True
        c = self.cfg.chunk_size
        hi = min(ctx.num_summaries, ctx.window_start // c)
        return any(j not in ctx.chunks
                   for j in self._lexical_chunks(tokens, -(-self.cfg.sink // c), hi))

    def select_chunks(self, ctx: DraftContext, tokens: Sequence[int]) -> List[ChunkJob]:
        """Re-pick the top chunks between the sinks and the window by query . mean key and
        return jobs for the newcomers (their KV is recomputed over the sinks).

        A full pick happens when the view has no chunks (after a split or a rebase); later
        refreshes swap in at most `_swaps` newcomers, each replacing the lowest-scored kept
        chunk that left the top set: a recomputed chunk costs a draft forward of its tokens,
        and re-picking every chunk each refresh cost more than the acceptance it bought
        (docs/decisions.md)."""
        cfg, c = self.cfg, self.cfg.chunk_size
        lo = -(-cfg.sink // c)
        hi = min(ctx.num_summaries, ctx.window_start // c)
        # Kept chunks must still lie before the window and sit where the view expects them:
        # their true position before any rebase, the region after the sinks after one.
        for j, (slots, pos) in list(ctx.chunks.items()):
            if not (lo <= j < hi and self._chunk_pos_valid(ctx, j, pos)):
                self._free(slots)
                del ctx.chunks[j]
        ranked: List[int] = []
        scores = None
        lexical = self._lexical_chunks(tokens, lo, hi) if cfg.num_chunks else []
        if hi > lo and cfg.num_chunks:
            bank = ctx.summaries[lo:hi].float()  # [N, layers, kv_heads, head_dim]
            scores = (bank * ctx.query.unsqueeze(0)).sum((1, 2, 3))
            by_key = [int(j) + lo for j in torch.topk(scores, min(cfg.num_chunks, hi - lo)).indices]
            ranked = (lexical + [j for j in by_key if j not in lexical])[: cfg.num_chunks]
        top = set(ranked)
        cap = cfg.num_chunks if not ctx.chunks else self._swaps()
        # Lexical hits always enter (the text is being copied from there now); key-score
        # newcomers at most `cap` per refresh.
        newcomers = [j for j in lexical if j not in ctx.chunks]
        newcomers += [j for j in ranked if j not in ctx.chunks and j not in lexical][:cap]
        # Make room: drop kept chunks that left the top set, lowest score first.
        leaving = sorted((j for j in ctx.chunks if j not in top),
                         key=lambda j: float(scores[j - lo]) if scores is not None else 0.0)
        while len(ctx.chunks) + len(newcomers) > cfg.num_chunks:
            j = leaving.pop(0)
            self._free(ctx.chunks.pop(j)[0])
        taken = {pos for _, pos in ctx.chunks.values()}
        free_pos = [cfg.sink + k * c for k in range(cfg.num_chunks)
                    if cfg.sink + k * c not in taken]
        jobs = []
        for j in sorted(newcomers):  # after a rebase: document order in the free positions
            pos = j * c if ctx.base == 0 else free_pos.pop(0)
            slots = self.allocator.alloc(c)
            assert slots is not None, "draft KV pool exhausted despite the reservation"
            ctx.chunks[j] = (slots, pos)
            jobs.append(ChunkJob(j, list(tokens[j * c:(j + 1) * c]), slots,
                                 torch.arange(pos, pos + c, dtype=torch.int64)))
        ctx.steps_since_refresh, ctx.need_refresh = 0, False
        return jobs

    def _lexical_chunks(self, tokens: Sequence[int], lo: int, hi: int) -> List[int]:
        """Chunks in [lo, hi) that hold what followed the text's latest tokens where they
        occurred earlier in the document (longest suffix match, latest occurrence first):
        a model quoting a clause copies it, and mean keys alone often miss the clause
        (docs/decisions.md)."""
        c = self.cfg.chunk_size
        a, b, end = lo * c, hi * c, len(tokens)
        cap = max(1, self.cfg.num_chunks // 4)
        found: List[int] = []
        if b - a < min(_LEXICAL_NGRAMS):
            return found
        region = torch.tensor(tokens[a:b], dtype=torch.int64)  # read once for every n
        for n in _LEXICAL_NGRAMS:
            if end < n or b - a < n:
                continue
            suffix = torch.tensor(tokens[end - n:end], dtype=torch.int64)
            hits = (region.unfold(0, n, 1) == suffix).all(1).nonzero().flatten()
            if len(hits) == 0:
                continue
            for e in reversed((hits + a + n).tolist()):  # e: the first token after a match
                # the continuation's chunk, and the next one when e is in its last quarter
                for j in (e // c, (e + c // 4) // c):
                    if lo <= j < hi and j not in found:
                        found.append(j)
                if len(found) >= cap:
                    break
            break
        return found[:cap]

    def _swaps(self) -> int:
        """Newcomers one refresh may bring into a view that already has chunks."""
        return max(1, self.cfg.num_chunks // 4)

    def _chunk_pos_valid(self, ctx: DraftContext, j: int, pos: int) -> bool:
        c = self.cfg.chunk_size
        if ctx.base == 0:
            return pos == j * c
        return self.cfg.sink <= pos < self.cfg.sink + self.cfg.retrieved

    def _summarize(self, ctx: DraftContext, tokens: Sequence[int]) -> None:
        """Mean key per layer of every chunk completed so far, read before it can leave
        the view; also offered to the summary cache under the document's chain hash."""
        c = self.cfg.chunk_size
        while (ctx.num_summaries + 1) * c <= ctx.computed:
            j = ctx.num_summaries
            slots = self._resident_slots(ctx, j * c, (j + 1) * c)
            summary = torch.stack([self.kv_pool.get_kv(layer)[0][slots].float().mean(0)
                                   for layer in range(self.num_layers)])  # [L, KVH, hd]
            summary = summary.to(self.kv_pool.dtype)  # stored like the KV (bf16 halves it)
            self._add_summary(ctx, summary)
            self.summary_cache.put(self._chain(ctx, tokens, j + 1)[j], summary)

    def _add_summary(self, ctx: DraftContext, summary: torch.Tensor) -> None:
        bank = ctx.summaries
        if bank is None or ctx.num_summaries == len(bank):  # grow geometrically
            grown = torch.empty((max(16, 2 * ctx.num_summaries), *summary.shape),
                                dtype=summary.dtype)
            if bank is not None:
                grown[: ctx.num_summaries] = bank[: ctx.num_summaries]
            ctx.summaries = bank = grown
        bank[ctx.num_summaries] = summary
        ctx.num_summaries += 1

    def _chain(self, ctx: DraftContext, tokens: Sequence[int], num_chunks: int) -> List[int]:
        """Chained hashes of chunks [0, num_chunks): equal iff the documents agree so far."""
        c = self.cfg.chunk_size
        while len(ctx.chain) < num_chunks:
            j = len(ctx.chain)
            prev = ctx.chain[-1] if ctx.chain else 0
            ctx.chain.append(hash((prev, tuple(tokens[j * c:(j + 1) * c]))))
        return ctx.chain
