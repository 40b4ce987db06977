"""STANDALONE drafter: a small model with the target's tokenizer and its own KV pool.

Per step and request: catch the draft up to the request's last token (the root), then grow
a tree for `num_steps` levels: each level forwards the frontier (the `topk` best nodes of
the previous level) over the draft's view plus the frontier's ancestors (a tree mask over a
KV index list, no copies) and offers each frontier node's `topk` best children. The best
`budget` nodes by cumulative draft log-probability form the tree. Tree nodes' draft KV is
temporary: freed at the end of propose; accepted tokens are re-read by the next catch-up.

Which context the draft reads (the view), at which positions, and which draft KV a request
keeps are decided by `draft_kv.DraftKV` (--speculative-draft-kv-policy); this module only
runs the forwards it asks for. Draft KV of a shared prefix comes from and goes back to the
radix cache through `adopt` / `draft_prefix` / `on_cached` / `release`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.distributed.parallel_state import rank0_value, replicated
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.draft_kv import DEFAULT_BUDGET, DraftKV, DraftKVConfig
from sglang.srt.speculative.draft_kv_state import ChunkJob, DraftContext, Piece, QueryRecorder
from sglang.srt.speculative.drafters.base import (NO_OBSERVER, CatchUpRecord, DraftKVOwner,
                                                  DraftObserver, Drafter)
from sglang.srt.speculative.drafters.tree_grow import TreeGrowMixin
from sglang.srt.speculative.tree import DraftTree

logger = logging.getLogger(__name__)


def draft_pool_size(server_args, max_running: int, max_total_tokens: int, tree_slots: int) -> int:
    """Draft KV slots: as many as the target's for `full` (plus tree room); for a bounded
    policy, every running request's budget and tree, twice (room for cached prefixes)."""
    if server_args.speculative_draft_max_total_tokens:
        return server_args.speculative_draft_max_total_tokens
    full = max_total_tokens + max_running * (tree_slots + 1)
    if server_args.speculative_draft_kv_policy == "full":
        return full
    budget = server_args.speculative_draft_kv_budget or DEFAULT_BUDGET
    return min(full, 2 * max_running * (budget + tree_slots))


class StandaloneDrafter(TreeGrowMixin, Drafter, DraftKVOwner):
    """A small model of the target's tokenizer drafts EAGLE-2-style trees; its KV hangs off
    the radix cache beside the target's (it is its own `draft_kv`)."""

    name = "standalone"
    draft_architecture: Optional[str] = None  # a class to build from the draft checkpoint

    def __init__(self, server_args, max_running: int, context_len: int, max_total_tokens: int,
                 num_steps: int, topk: int, chunk_size: int) -> None:
        self.num_steps = num_steps
        self.topk = topk
        self.chunk_size = chunk_size
        self.tree_slots = topk * max(num_steps, 1) + 1  # draft slots one tree may take
        pool = draft_pool_size(server_args, max_running, max_total_tokens, self.tree_slots)
        with replicated():  # under TP every rank drafts with the whole draft model
            self.runner = ModelRunner(server_args,
                                      model_path=server_args.speculative_draft_model_path,
                                      max_context_len=context_len, max_total_tokens=pool,
                                      architecture=self.draft_architecture, graphs=False)
        self.allocator = self.runner.allocator
        if server_args.speculative_token_map:
            self._use_token_map(server_args.speculative_token_map)
        # Retrieval scores chunks against the draft's own queries: record them on the way.
        self.recorder = QueryRecorder(self.runner.attn_backend)
        self.runner.attn_backend = self.recorder
        cfg = DraftKVConfig.from_server_args(
            server_args, getattr(self.runner.config, "max_position_embeddings", 4096),
            num_steps, chunk_size)
        self.kv = DraftKV(cfg, self.allocator, self.runner.kv_pool, self.runner.num_layers,
                          summary_capacity=max(1024, max_total_tokens // cfg.chunk_size))
        if not cfg.bounded and context_len > cfg.max_position:
            logger.warning("Draft context policy 'full': contexts over %d tokens put the draft "
                           "past its trained positions; --speculative-draft-kv-policy "
                           "streaming|retrieval keeps them in range", cfg.max_position)
        logger.info("Draft KV: policy %s, budget %s, pool %d slots", cfg.policy,
                    cfg.budget or "unbounded", pool)
        self.req_to_token = ReqToTokenPool(max_running, context_len + 8)
        self.contexts: Dict[str, DraftContext] = {}
        self._evict: Optional[Callable[[int], int]] = None  # the cache's unlocked draft KV
        self.observer: DraftObserver = NO_OBSERVER
        self._read = CatchUpRecord()
        self._computed = 0  # tokens the running catch-up has sent through the draft

    @property
    def draft_kv(self) -> DraftKVOwner:
        return self

    @property
    def model_config(self):
        return self.runner.config

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.runner.model.parameters())

    def observe(self, observer: DraftObserver) -> None:
        self.observer = observer

    def set_evictor(self, evict: Callable[[int], int]) -> None:
        self._evict = evict

    def begin_proposal(self) -> None:
        self._read = dataclasses.replace(self._read, backlog_tokens=0, requests=0)

    def last_read(self) -> CatchUpRecord:
        return self._read

    def _use_token_map(self, path: str) -> None:
        """Score only the map's tokens in every draft forward (speculative/token_map.py)."""
        from sglang.srt.speculative.token_map import HotVocabHead, load_token_map

        model = self.runner.model
        head = getattr(model, "lm_head", None)
        if head is None or not hasattr(head, "weight"):
            raise ValueError("--speculative-token-map: the draft model has no lm_head to limit")
        ids = load_token_map(path, head.weight.shape[0])
        model.lm_head = HotVocabHead(head.weight, ids)
        logger.info("Draft token map: %d of %d tokens (%s)", ids.numel(), head.weight.shape[0],
                    path)

    # ------------------------------------------------------------------ radix cache seam
    def context(self, req) -> DraftContext:
        ctx = self.contexts.get(req.rid)
        if ctx is None:
            ctx = DraftContext(self.req_to_token.req_to_token[req.req_pool_idx])
            self.contexts[req.rid] = ctx
        return ctx

    def adopt(self, req, slots: torch.Tensor) -> int:
        """Start from the cache's draft slots for the request's prefix; returns the count."""
        return self.kv.adopt(self.context(req), slots) if len(slots) else 0

    def shareable_prefix(self, req, limit: int) -> Optional[torch.Tensor]:
        ctx = self.contexts.get(req.rid)
        return None if ctx is None else self.kv.shareable(ctx, limit)

    def on_cached(self, req, canonical: torch.Tensor, passed: int) -> None:
        ctx = self.contexts.get(req.rid)
        if ctx is not None:
            self.kv.on_cached(ctx, canonical, passed)

    def warm(self, req, upto: int) -> bool:
        """Catch the draft up on fill_ids[:upto] without proposing (a prefill-only request
        warming a document); False when the draft pool cannot hold it."""
        return self.warm_many([req], [upto])[0]

    def warm_many(self, reqs, ends: List[int]) -> List[bool]:
        """Catch the draft up on several prompts in one batched catch-up: a forward takes
        up to chunk_size tokens across requests (fewer, fuller forwards than one catch-up
        per request). Per request: False when the draft pool cannot hold it (it catches up
        later)."""
        live, live_ends, ok, reserved = [], [], [], 0
        for r, end in zip(reqs, ends):
            need = self.kv.need(self.context(r), end)
            fits = self._reserve(reserved + need)
            if fits:
                reserved += need
                live.append(r)
                live_ends.append(end)
            ok.append(fits)
        if live:
            self._catch_up(live, live_ends, want_logits=False)
        return ok

    def release_kv(self, req, keep: int) -> Optional[torch.Tensor]:
        """Drop the request's draft state; returns draft slots of its prefix [0, <= keep)
        for the radix cache (ownership passes with them); frees the rest."""
        ctx = self.contexts.pop(req.rid, None)
        return None if ctx is None else self.kv.release(ctx, keep)

    def backlog(self, req) -> int:
        """Tokens the draft is behind on for `req` (what its next catch-up reads; a
        streaming view skips what would leave its window unread)."""
        ctx = self.contexts.get(req.rid)
        behind = max(0, self._end(req) - (ctx.computed if ctx is not None else 0))
        cfg = self.kv.cfg
        return min(behind, cfg.sink + cfg.window) if cfg.policy == "streaming" else behind

    def resident(self, req) -> int:
        ctx = self.contexts.get(req.rid)
        return 0 if ctx is None else self.kv.resident(ctx)

    def _reserve(self, total: int) -> bool:
        short = total - self.allocator.available_size()
        if short > 0 and self._evict is not None:
            self._evict(short)  # the cache's unlocked draft KV goes first
        return total <= self.allocator.available_size()

    # ------------------------------------------------------------------ what the draft reads
    def _sequence(self, req) -> List[int]:
        """The ids of the draft's rows, by row index (a head's rows are shifted by one)."""
        return req.fill_ids

    def _end(self, req) -> int:
        """Rows the draft holds once caught up; the last one's logits draft past the root."""
        return req.fill_len

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as the target's (a head with a reduced vocabulary maps)."""
        return ids

    # ------------------------------------------------------------------ propose
    def propose(self, reqs, budgets, depth=None) -> List[Optional[DraftTree]]:
        steps = self.num_steps if depth is None else max(1, min(depth, self.num_steps))
        live, reserved = [], 0
        for r in reqs:
            ctx = self.context(r)
            # Keep draft KV strictly before the root, so catch-up always yields root logits.
            self.kv.truncate(ctx, self._end(r) - 1)
            need = self.kv.need(ctx, self._end(r)) + self.tree_slots
            # Short of draft slots: this request decodes plainly this step.
            if self._reserve(reserved + need):
                reserved += need
                live.append(r)
        self._read = CatchUpRecord(sum(self._end(r) - self.contexts[r.rid].computed
                                       for r in live), len(live))
        root_logits = self._catch_up(live, [self._end(r) for r in live], want_logits=True)
        for r in live:
            self.kv.step_done(self.contexts[r.rid])
        trees = self._grow(live, root_logits, [budgets[reqs.index(r)] for r in live], steps)
        out: Dict[str, DraftTree] = {r.rid: t for r, t in zip(live, trees)}
        return [out.get(r.rid) for r in reqs]

    def _catch_up(self, reqs, ends: List[int], want_logits: bool) -> List[Optional[torch.Tensor]]:
        """Draft-extend every request to ends[i] in pieces the policy chooses; returns the
        logits at ends[i] - 1 per request (when wanted). Timed into `last_read()`."""
        t0 = time.perf_counter()
        self._computed = 0
        try:
            return self._extend(reqs, ends, want_logits)
        finally:
            self._read = dataclasses.replace(self._read, computed_tokens=self._computed,
                                             seconds=rank0_value(time.perf_counter() - t0))

    def _extend(self, reqs, ends: List[int], want_logits: bool) -> List[Optional[torch.Tensor]]:
        tokens = [self._sequence(r) for r in reqs]
        ctxs = [self.context(r) for r in reqs]
        logits: List[Optional[torch.Tensor]] = [None] * len(reqs)
        while True:
            budget = max(self.chunk_size, 1)
            batch: List[Tuple[int, object, DraftContext, Piece, bool]] = []
            jobs: List[Tuple[object, DraftContext, ChunkJob]] = []
            for i, (r, ctx) in enumerate(zip(reqs, ctxs)):
                piece = self.kv.next_piece(ctx, tokens[i], ends[i], budget)
                if piece is None:
                    continue
                budget -= piece.n
                last = piece.start + piece.n == ends[i]
                final = want_logits and last
                # Retrieval re-picks chunks right before the root is read, with the query
                # of the latest piece, so the root's logits already see them; the first
                # pick (a whole view of chunks) comes with the prompt's catch-up, which
                # prefill pays for, instead of the first decode step.
                if last and self.kv.refresh_due(ctx, tokens[i]):
                    jobs += [(r, ctx, job) for job in self.kv.select_chunks(ctx, tokens[i])]
                batch.append((i, r, ctx, piece, final))
            if not batch:
                return logits
            self._computed += sum(b[3].n for b in batch) + sum(len(j[2].tokens) for j in jobs)
            out = self._forward_pieces(batch, tokens, jobs)
            k = 0
            for i, _, _, _, final in batch:
                if final:
                    logits[i] = out[k]
                    k += 1

    def _forward_pieces(self, batch, tokens: List[List[int]], jobs=()) -> torch.Tensor:
        """One forward for the pieces and the chunks entering the view (`jobs`, each over
        the sinks, placed after the pieces): every layer writes all new KV before any
        attention reads it, so a piece already sees the chunks' KV of the same forward.
        A separate forward per refresh cost a whole extra pass over the draft's weights."""
        ids: List[int] = []
        pos, locs, kv_idx, seq_lens, ext, rows, last = [], [], [], [], [], [], []
        read: Tuple[List[str], List[int]] = ([], [])  # (rid, token index) per piece row
        for i, r, ctx, piece, final in batch:
            view = self.kv.view(ctx)
            kv_idx.append(torch.cat([view, piece.slots]))  # new tokens last: causal mask
            ids += tokens[i][piece.start: piece.start + piece.n]
            read[0].extend([r.rid] * piece.n)
            read[1].extend(range(piece.start, piece.start + piece.n))
            pos.append(piece.positions)
            locs.append(piece.slots)
            seq_lens.append(len(view) + piece.n)
            ext.append(piece.n)
            last.append(len(ids) - 1)
            if final:
                rows.append(len(ids) - 1)
        for _, ctx, job in jobs:
            kv_idx.append(torch.cat([self.kv.sinks(ctx), job.slots]))
            ids += job.tokens
            pos.append(job.positions)
            locs.append(job.slots)
            seq_lens.append(len(kv_idx[-1]))
            ext.append(len(job.tokens))
        if self.kv.cfg.policy == "retrieval":
            self.recorder.rows = torch.tensor(last, dtype=torch.int64)
        fb = self._batch([b[1] for b in batch] + [j[0] for j in jobs], ids, torch.cat(pos),
                         seq_lens, ext, torch.cat(locs), rows, kv_indices=kv_idx)
        roots = [b[1].rid for b in batch if b[4]]
        out = self._forward_telling(fb, roots, [ids[k] for k in rows], rows, read)
        queries = self.recorder.take()  # [len(batch), layers, heads, head_dim] or None
        for k, (i, _, ctx, piece, _) in enumerate(batch):
            self.kv.commit(ctx, piece, tokens[i])
            if queries is not None:
                self.kv.set_query(ctx, queries[k])
        return out

    def _forward_telling(self, fb: ForwardBatch, rids: List[str], tokens: List[int],
                         rows: List[int], read: Optional[Tuple[List[str], List[int]]] = None,
                         nodes: Optional[List[Tuple[DraftTree, int]]] = None) -> torch.Tensor:
        """runner.forward; for an observer that wants them, also each layer's residual stream
        at `rows` (the proposal's roots or nodes: what the target's routers will read) and
        at the catch-up tokens it learns from (read = (rid, token index) per row; a tree
        level's forward passes `nodes` instead, (tree, node) per row)."""
        tell = bool(rows) and self.observer.wants_hidden()
        limit = self.observer.catch_up_rows() if read else 0
        learn_rows = [j for j, t in enumerate(read[1]) if t < limit] if limit else []
        if not tell and not learn_rows:
            return self.runner.forward(fb)
        index = torch.tensor(rows, dtype=torch.int64)
        learn = torch.tensor(learn_rows, dtype=torch.int64)
        hidden: Dict[int, torch.Tensor] = {}
        pieces: Dict[int, torch.Tensor] = {}

        def hook(layer: int, residual: torch.Tensor) -> None:  # copies: layers add in place
            nonlocal index, learn
            if index.device != residual.device:  # once per forward, not once per layer
                index, learn = index.to(residual.device), learn.to(residual.device)
            if tell:
                hidden[layer] = residual.index_select(0, index)
            if learn_rows:
                pieces[layer] = residual.index_select(0, learn)

        fb.residual_hook = hook
        out = self.runner.forward(fb)
        if learn_rows:
            self.observer.on_catch_up([read[0][j] for j in learn_rows],
                                      [read[1][j] for j in learn_rows], pieces)
        if tell:
            self.observer.on_hidden(rids, tokens, hidden)
        return out

    def _batch(self, reqs, ids: List[int], pos: torch.Tensor, seq_lens: List[int],
               ext: List[int], out_loc: torch.Tensor, rows: List[int],
               kv_indices: Sequence[torch.Tensor], custom_mask=None,
               custom_mask_tails: Optional[List[int]] = None) -> ForwardBatch:
        # every tensor on the draft's device, moved here once (the host builds the rows)
        dev = self.runner.device
        pool_rows = [r.req_pool_idx for r in reqs]
        return ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev), positions=pos.to(dev),
            req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            extend_seq_lens=torch.tensor(ext, device=dev),
            out_cache_loc=out_loc.to(dev), req_to_token_pool=self.req_to_token,
            token_to_kv_pool=self.runner.kv_pool, attn_backend=self.runner.attn_backend,
            seq_lens_cpu=list(seq_lens), extend_seq_lens_cpu=list(ext),
            req_pool_indices_cpu=pool_rows,
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            kv_indices=[k if k is None or isinstance(k, slice) else k.to(dev) for k in kv_indices],
            custom_mask=None if custom_mask is None else [
                None if m is None else m.to(dev) for m in custom_mask],
            custom_mask_tails=custom_mask_tails)

    # ------------------------------------------------------------------ memory
    def check_all_free(self) -> None:
        assert not self.contexts, f"draft KV still held for {list(self.contexts)}"
        self.allocator.check()
        assert self.allocator.available_size() == self.allocator.size, "draft KV slots leaked"


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> StandaloneDrafter:
    """STANDALONE: a draft model (--speculative-draft-model-path) of the same tokenizer."""
    if not cfg.draft_model_path:
        raise ValueError(f"--speculative-algorithm {cfg.algorithm} needs "
                         "--speculative-draft-model-path")
    return StandaloneDrafter(server_args, max_running, context_len, max_total_tokens,
                             cfg.num_steps, cfg.topk, chunk_size)
