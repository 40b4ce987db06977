"""Scheduler: continuous batching over one target model.

One step: admit waiting requests -> plan the tokens each running request computes (decodes
1, prefills a chunk within the budget) -> hooks: prefetch, draft trees, cut trees -> allocate
KV slots (evicting cache, retracting requests when the pool is short: scheduler_memory.py)
-> one forward -> sample, or verify trees -> hooks: record -> release finished requests.
Speculation and expert offload plug in as step hooks (step_hooks.py) handed over at
construction.
"""

from __future__ import annotations

import collections
import time
from typing import Deque, Dict, List, Optional

import torch

from sglang.srt.constrained.grammar_backend import GrammarBackend, grammar_key
from sglang.srt.distributed.parallel_state import rank0_value
from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.managers.io_struct import ReqUpdate, TokenizedGenerateReqInput
from sglang.srt.managers.output_processor import OutputProcessor
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.batch_builder import build_forward_batch
from sglang.srt.managers.schedule_policy import order_waiting
from sglang.srt.managers.scheduler_memory import SchedulerMemoryMixin
from sglang.srt.managers.scheduler_state import SchedulerStateMixin
from sglang.srt.managers.step_hooks import SpeculationHook, StepHook, StepHooks
from sglang.srt.managers.step_plan import ScheduledReq, StepPlan
from sglang.srt.mem_cache.base_prefix_cache import create_prefix_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_worker import SpecWorker
from sglang.srt.utils import host_sync

# Slots kept free per running request when admitting new ones, so that decoding requests
# rarely have to be retracted right after an admission.
_DECODE_RESERVE_PER_REQ = 16


class Scheduler(SchedulerStateMixin, SchedulerMemoryMixin):
    def __init__(self, server_args: ServerArgs, tokenizer=None,
                 runner: Optional[ModelRunner] = None) -> None:
        self.server_args = server_args
        self.max_running = server_args.max_running_requests or 64
        self.runner = runner or ModelRunner(server_args, max_running_requests=self.max_running)
        self.prefetcher = self.runner.prefetcher  # expert prefetch (--moe-prefetch-predictor)
        if self.runner.expert_store is not None:
            # expert distribution dumps carry the target's store and prefetch figures
            get_expert_recorder().extras["moe"] = self.moe_state
        self.context_len = self.runner.context_len
        self.sync_stats = host_sync.SyncStats()  # the step's device-to-host reads
        self.allocator = self.runner.allocator
        chunk = server_args.chunked_prefill_size
        self.prefill_budget = chunk if chunk and chunk > 0 else server_args.max_prefill_tokens
        self.grammar_backend = (GrammarBackend(tokenizer, self.runner.vocab_size)
                                if tokenizer is not None else None)
        self.spec: Optional[SpecWorker] = None
        if server_args.speculative_algorithm:
            self.spec = SpecWorker(server_args, self.runner.vocab_size, self.max_running,
                                   self.context_len, self.allocator.size, self.prefill_budget,
                                   target_params=_num_params(self.runner.model),
                                   grammar_backend=self.grammar_backend)
            self.spec.bind_target(self.runner)
            if not self.spec.capture_layers:  # an EAGLE-3 head's verifies capture features
                self.runner.capture_verify_graphs(self.spec.max_tree_nodes)
        tree_room = self.spec.max_tree_nodes if self.spec else 0
        self.req_to_token_pool = ReqToTokenPool(self.max_running, self.context_len + tree_room + 8,
                                                device=self.runner.device)
        # One tree for both models: nodes carry draft slots beside target slots.
        self.tree_cache = create_prefix_cache(
            server_args.disable_radix_cache, self.allocator,
            draft_allocator=self.spec.draft_allocator if self.spec else None,
            eviction_policy=server_args.radix_eviction_policy)
        self.tree_budget = None  # --moe-prefetch-prune-tree (TreeBudgetHook)
        self.hooks = StepHooks(self._build_hooks())
        self.outputs = OutputProcessor(self.runner.vocab_size, tokenizer,
                                       eos_token_ids=_eos_ids(self.runner.config, tokenizer),
                                       extra_meta=self.spec.meta_info if self.spec else None,
                                       grammar_backend=self.grammar_backend)
        self.waiting: Deque[Req] = collections.deque()
        self.rejected: List[Req] = []  # failed before running (bad grammar); reported next step
        self.running: List[Req] = []
        self.step_count = 0
        self.seed_rng = torch.Generator().manual_seed(
            server_args.random_seed if server_args.random_seed is not None else 42)
        self.stats: Dict[str, float] = collections.defaultdict(float)
        self.spec_calibration = None  # the CalibrationReport, once calibrate() ran

    def _build_hooks(self) -> List[StepHook]:
        """Speculation and expert offload, wired once: the draft tells the prefetcher what
        it drafts; the cache frees draft KV when the draft pool is short."""
        hooks: List[StepHook] = []
        spec, prefetcher = self.spec, self.prefetcher
        if prefetcher is not None:
            from sglang.srt.managers.offload_hooks import PrefetchHook

            hooks.append(PrefetchHook(prefetcher))
        if spec is None:
            return hooks
        spec.attach_cache(self.tree_cache)
        hooks.append(SpeculationHook(spec, lambda: self.running))
        if spec.draft_kv.enabled and prefetcher is not None:
            from sglang.srt.expert_offload.draft_observer import PrefetchDraftObserver

            cfg = spec.draft_kv.model_config
            spec.drafter.observe(PrefetchDraftObserver(prefetcher, cfg.hidden_size,
                                                       cfg.num_hidden_layers))
        if prefetcher is not None and self.server_args.moe_prefetch_prune_tree:
            from sglang.srt.expert_offload.tree_budget import TreeBudget
            from sglang.srt.managers.offload_hooks import TreeBudgetHook

            self.tree_budget = TreeBudget()
            hooks.append(TreeBudgetHook(self.tree_budget, prefetcher, spec))
        return hooks

    # ------------------------------------------------------------------ requests
    def add_request(self, recv: TokenizedGenerateReqInput) -> Optional[ReqUpdate]:
        """Queue a request; returns an immediate abort update if it can never run."""
        req = Req(rid=recv.rid, origin_input_ids=list(recv.input_ids),
                  sampling_params=recv.sampling_params, return_logprob=recv.return_logprob,
                  logprob_start_len=recv.logprob_start_len,
                  top_logprobs_num=recv.top_logprobs_num,
                  token_ids_logprob=recv.token_ids_logprob, stream=recv.stream)
        self.outputs.init_req(req)
        error = self._validate(req)
        if error:
            req.finished_reason = {"type": "abort", "message": error, "status_code": 400,
                                   "err_type": "BadRequestError"}
            return self.outputs.make_update(req)
        key = grammar_key(req.sampling_params)
        if key is not None:
            if self.grammar_backend is None:
                req.finished_reason = {"type": "abort", "status_code": 400,
                                       "message": "regex / json_schema / ebnf need a tokenizer; "
                                                  "this server runs with --skip-tokenizer-init"}
                return self.outputs.make_update(req)
            req.grammar_future = self.grammar_backend.request(key)
        seed = req.sampling_params.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_rng))
        req.generator = torch.Generator().manual_seed(seed)
        self.waiting.append(req)
        return None

    def _validate(self, req: Req) -> Optional[str]:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty: send at least one token."
        if n >= self.context_len:
            return (f"The input ({n} tokens) is longer than the model's context length "
                    f"({self.context_len} tokens).")
        if n + 1 > self.allocator.size:
            return (f"The input ({n} tokens) does not fit in the KV pool "
                    f"({self.allocator.size} tokens); raise --max-total-tokens.")
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            return f"input_ids contain {bad[0]}, not a token id of this model (vocab {self.runner.vocab_size})."
        return None

    def abort(self, rid: str, message: str = "Aborted by the client.") -> List[ReqUpdate]:
        updates = []
        for req in list(self.waiting) + list(self.running):
            if rid and req.rid != rid:
                continue
            req.finished_reason = {"type": "abort", "message": message}
            if req in self.running:
                self._release(req)
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            updates.append(self.outputs.make_update(req))
            self.hooks.on_finished(req)
        return updates

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        return True

    # ------------------------------------------------------------------ the step
    def step(self) -> List[ReqUpdate]:
        """Run one forward (if there is work); return the updates to send."""
        self.step_count += 1
        host_sync.take()  # reads between steps are not the step's
        self._admit()
        updates = [self.outputs.make_update(r) for r in self.rejected]
        self.rejected.clear()
        plan = self._plan()
        if plan is None:
            if self.waiting:
                time.sleep(0.002)  # only grammars compiling: do not spin
            return updates
        t0 = time.perf_counter()
        self.hooks.before_draft(plan)  # expert loads start while the draft proposes
        self.hooks.draft(plan)  # speculation: draft trees for decoding requests
        self.hooks.before_allocate(plan)  # budget-aware trees drop dear branches
        updates += self._allocate(plan)
        if plan.items:
            self.hooks.before_forward(plan)  # loads for the pass's own tokens
            fb, rows = build_forward_batch(plan, self.req_to_token_pool, self.runner,
                                           self.outputs)
            logits = self.runner.forward(fb)
            plan.captured = fb.captured_hidden  # an EAGLE-3 head's features, if asked
            self._postprocess(plan, logits, rows)
        self.hooks.after_forward(plan)  # acceptance, draft catch-up, cost model
        # gates time the whole step (rank 0's time on every TP rank)
        self.hooks.after_step(plan, rank0_value(time.perf_counter() - t0))
        updates += self._finish(plan)
        self.sync_stats.record(host_sync.take(), plan.decode_only)
        return updates

    def _finish(self, plan: StepPlan) -> List[ReqUpdate]:
        """Release finished requests; the updates of every request the step touched."""
        finished = [r for r in self.running if r.finished]
        for req in finished:
            self._release(req)
            self.running.remove(req)
        touched = plan.reqs + [r for r in finished if r not in plan.reqs]
        updates = [u for r in touched if (u := self.outputs.maybe_update(r)) is not None]
        for req in finished:
            self.hooks.on_finished(req)
        return updates

    def _admit(self) -> None:
        if not self.waiting:
            return
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        free -= sum(r.fill_len - r.kv_len + _DECODE_RESERVE_PER_REQ for r in self.running)
        ordered = order_waiting(self.server_args.schedule_policy, list(self.waiting),
                                self.tree_cache, self.server_args.disable_radix_cache)
        for req in ordered:
            if len(self.running) >= self.max_running or self.req_to_token_pool.available_size() == 0:
                break
            if not self._grammar_ready(req):
                continue
            cap = req.fill_len - 1  # at least one token is computed, to get logits
            if req.wants_input_logprobs and not req.input_logprobs_done:
                cap = min(cap, req.logprob_start_len)
            match = self.tree_cache.match_prefix(req.fill_ids[:cap])
            need = req.fill_len - match.length + _DECODE_RESERVE_PER_REQ
            if need > free and self.running:
                break  # wait for memory; an idle engine always admits (retraction handles it)
            free -= need
            self.tree_cache.lock(match.handle)
            req.cache_handle = match.handle
            req.req_pool_idx = self.req_to_token_pool.alloc()
            self.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
            req.kv_len = req.cache_protected_len = match.length
            if req.total_retractions == 0:
                req.cached_tokens = match.length
            if self.spec is not None:  # draft KV: the drafter adopts the cached draft prefix
                self.spec.adopt(req, match)
            req.admitted_step = self.step_count
            self.waiting.remove(req)
            self.running.append(req)

    def _grammar_ready(self, req: Req) -> bool:
        """False while the request's grammar compiles; a bad grammar aborts the request."""
        fut = req.grammar_future
        if fut is None or req.grammar is not None:
            return True
        if not fut.done() and self.runner.tp_size == 1:
            return False  # under TP every rank must admit alike: wait for the compile below
        try:
            req.grammar = self.grammar_backend.new_matcher(fut.result())
            for tok in req.output_ids:  # resumed after retraction: replay what was emitted
                req.grammar.accept_token(tok)
        except ValueError as e:
            req.finished_reason = {"type": "abort", "status_code": 400, "message": str(e)}
            self.waiting.remove(req)
            self.rejected.append(req)
            return False
        return True

    def _plan(self) -> Optional[StepPlan]:
        if not self.running:
            return None
        budget = self.prefill_budget
        items: List[ScheduledReq] = []
        # Decodes first: they always advance; prefill chunks share what budget remains.
        for req in sorted(self.running, key=lambda r: r.fill_len - r.kv_len > 1):
            remaining = req.fill_len - req.kv_len
            if remaining == 1:
                n = 1
            else:
                n = min(remaining, budget)
                if n <= 0:
                    continue
                budget -= n
            items.append(ScheduledReq(req, n))
        return StepPlan(items, decode_only=bool(items) and all(it.count == 1 for it in items))

    def _postprocess(self, plan: StepPlan, logits: torch.Tensor, rows) -> None:
        spans, offset = [], 0  # each request's logits rows: a tree's nodes, or r's rows
        for it, r in zip(plan.items, rows):
            k = it.num_tokens if it.tree is not None else len(r.all_rows())
            spans.append(logits[offset : offset + k])
            offset += k
        targets = self.spec.greedy_targets(  # every greedy tree's argmax in one read
            [(it.req, it.tree, x) for it, x in zip(plan.items, spans) if it.tree is not None]
        ) if plan.has_trees else {}
        samplers = []
        for it, r, req_logits in zip(plan.items, rows, spans):
            req, n = it.req, it.num_tokens
            if it.tree is not None:
                self._accept_tree(it, req_logits, targets.get(req.rid))
                continue
            req.kv_len += n
            self.outputs.collect_input_logprobs(req, r, req_logits)
            if req.kv_len == req.fill_len:
                if req.fill_len == len(req.origin_input_ids) and req.max_new_tokens == 0:
                    req.finished_reason = {"type": "length", "length": 0}
                else:
                    samplers.append((req, req_logits[-1]))
            else:
                self._cache_progress(req)  # a prefill chunk ended
        if samplers:
            self.outputs.sample_and_append([s[0] for s in samplers],
                                           torch.stack([s[1] for s in samplers]))

    def _accept_tree(self, it: ScheduledReq, logits: torch.Tensor,
                     target_ids: Optional[List[int]]) -> None:
        """Append the accepted run; keep the KV of its nodes, free the rest of the tree."""
        req, tree = it.req, it.tree
        result = self.spec.verify(req, tree, logits, target_ids)
        # the path's rows only for logprobs: gathering 10 vocab-wide rows costs ~0.5 ms
        path_logits = logits[result.path] if req.return_logprob else None
        emitted = self.outputs.append_verified(req, result.tokens, path_logits)
        it.offered, it.emitted = max(tree.depths), emitted
        it.accepted = min(emitted, result.num_accepted_drafts)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        tree_slots = row[req.kv_len : req.kv_len + len(tree)].clone()
        keep = result.path[:emitted]  # the root plus every accepted node still in the output
        it.kept = keep
        row[req.kv_len : req.kv_len + len(keep)] = tree_slots[keep]
        kept = set(keep)  # the rest by index, known on the host (a bool mask would sync)
        dropped = [i for i in range(len(tree)) if i not in kept]
        self.allocator.free(tree_slots[torch.tensor(dropped, dtype=torch.int64,
                                                    device=tree_slots.device)])
        req.kv_len += len(keep)

def _eos_ids(config, tokenizer) -> set:
    ids = set()
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _num_params(model) -> int:
    """Parameters the module holds (a rough price ratio: an MoE's offloaded experts are not
    counted, which only makes a draft token look dearer)."""
    return sum(p.numel() for p in model.parameters())
