"""KV memory of the scheduler's requests: slots for each step's tokens (evicting cache, then
retracting the newest request, when the pool is short), prompts shared through the prefix
cache as chunks finish, and a request's KV handed to the cache when it ends or is
retracted. A mixin of Scheduler."""

from __future__ import annotations

import logging
from typing import List

from sglang.srt.managers.io_struct import ReqUpdate
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.step_plan import StepPlan

logger = logging.getLogger("sglang.srt.managers.scheduler")


class SchedulerMemoryMixin:
    def _allocate(self, plan: StepPlan) -> List[ReqUpdate]:
        """Give every planned token a KV slot; evict cache, then retract, when short."""
        updates: List[ReqUpdate] = []
        while plan.items:
            need = sum(it.num_tokens for it in plan.items)
            short = need - self.allocator.available_size()
            if short > 0:
                self.tree_cache.evict(short)
                short = need - self.allocator.available_size()
            if short <= 0:
                break
            if len(self.running) == 1:
                # One request alone does not fit: shrink its chunk, or fail it clearly.
                avail, first = self.allocator.available_size(), plan.items[0]
                if avail > 0 and first.num_tokens > 1 and first.tree is None:
                    first.count = min(first.count, avail)
                    continue
                req = self.running[0]
                req.finished_reason = {"type": "abort", "status_code": 400,
                                       "message": "The KV pool is too small for this request; "
                                                  "raise --max-total-tokens."}
                plan.items = []
                break
            victim = max(self.running, key=lambda r: (r.admitted_step, r.fill_len))
            self._retract(victim)
            plan.items = [it for it in plan.items if it.req is not victim]
        for it in plan.items:
            slots = self.allocator.alloc(it.num_tokens)
            self.req_to_token_pool.write(it.req.req_pool_idx, it.req.kv_len, slots)
        return updates

    def _cache_progress(self, req: Req) -> None:
        """Share a chunk-prefilled prompt through the tree while the request runs on."""
        row = req.req_pool_idx
        slots = self.req_to_token_pool.req_to_token[row, : req.kv_len]
        draft = self.spec.draft_prefix(req) if self.spec is not None else None
        indices, handle = self.tree_cache.cache_unfinished(req.fill_ids[: req.kv_len], slots,
                                                           req.cache_handle, draft_slots=draft)
        self.req_to_token_pool.write(row, 0, indices)
        if draft is not None:  # draft KV: the cache now owns (and may have swapped) these
            self.spec.on_cached(req, self.tree_cache.draft_indices(handle), len(draft))
        req.cache_handle = handle
        req.cache_protected_len = len(indices)

    def _release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (which frees what it does not keep)."""
        if req.req_pool_idx is None:
            return
        # Draft KV: the drafter frees what it keeps alone and hands a prefix to the cache.
        draft = self.spec.release(req) if self.spec is not None else None
        row = req.req_pool_idx
        slots = self.req_to_token_pool.req_to_token[row, : req.kv_len].clone()
        self.tree_cache.cache_finished(req.fill_ids[: req.kv_len], slots, req.cache_handle,
                                       draft_slots=draft)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.cache_handle = None
        req.kv_len = 0
        req.grammar = None  # rebuilt (and replayed) if the request resumes

    def _retract(self, req: Req) -> None:
        logger.info("KV pool full: retracting request %s (%d tokens); it resumes later",
                    req.rid, req.fill_len)
        self._release(req)
        self.running.remove(req)
        req.total_retractions += 1
        self.waiting.appendleft(req)
