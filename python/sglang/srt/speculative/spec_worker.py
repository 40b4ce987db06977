"""SpecWorker: orchestrates one speculative step for the scheduler.

It decides which decoding requests speculate (and with how many tree nodes), asks the
drafter for trees, and after the target's verify pass picks each request's accepted path.
Memory and batching stay in the scheduler; acceptance math lives in verify.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.sampling.sampler import apply_logit_adjustments, logits_to_probs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.controller import (AcceptanceEMA, CostModel, FallbackConfig,
                                               RequestController, StepTimer)
from sglang.srt.speculative.tree import DraftTree
from sglang.srt.speculative.verify import VerifyResult, verify_greedy, verify_sampling

logger = logging.getLogger(__name__)

ALGORITHMS = ("STANDALONE", "NGRAM", "HYBRID")
TYPICAL_BACKLOG = 64  # draft catch-up tokens per request beyond which a step is atypical
CATCH_UP_SAMPLE = 64  # catch-ups of at least this many tokens price a draft token


def resolve_spec_defaults(server_args) -> Tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) with upstream's automatic defaults."""
    algo = server_args.speculative_algorithm.upper()
    if algo == "NGRAM":
        steps = server_args.speculative_num_steps or server_args.speculative_ngram_max_trie_depth
        topk = server_args.speculative_eagle_topk or 1
        draft = server_args.speculative_num_draft_tokens or 12
        return steps, topk, draft
    steps = server_args.speculative_num_steps or 3
    topk = server_args.speculative_eagle_topk or 1
    draft = server_args.speculative_num_draft_tokens
    if algo == "HYBRID":  # room for n-gram branches beside the draft model's
        return steps, topk, draft or max(steps * topk + 1, 8)
    if topk == 1:
        draft = steps + 1  # a chain: the root plus one token per step
    elif draft is None:
        draft = min(steps * topk, 8) + 1
    return steps, topk, draft


class SpecWorker:
    def __init__(self, server_args, vocab_size: int, max_running: int, context_len: int,
                 max_total_tokens: int, chunk_size: int) -> None:
        self.algorithm = server_args.speculative_algorithm.upper()
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {ALGORITHMS}, "
                             f"got {server_args.speculative_algorithm!r}")
        self.num_steps, self.topk, self.num_draft_tokens = resolve_spec_defaults(server_args)
        self.vocab_size = vocab_size
        self.context_len = context_len
        if self.algorithm == "NGRAM":
            from sglang.srt.speculative.drafters.ngram import NgramDrafter

            self.drafter = NgramDrafter(max_depth=max(self.num_draft_tokens - 1, 1))
        else:
            from sglang.srt.speculative.drafters.standalone import StandaloneDrafter

            if not server_args.speculative_draft_model_path:
                raise ValueError(f"--speculative-algorithm {self.algorithm} needs "
                                 "--speculative-draft-model-path")
            model = StandaloneDrafter(server_args, max_running, context_len, max_total_tokens,
                                      self.num_steps, self.topk, chunk_size)
            self.drafter = model
            if self.algorithm == "HYBRID":
                from sglang.srt.speculative.drafters.hybrid import HybridDrafter
                from sglang.srt.speculative.drafters.ngram import NgramDrafter

                self.drafter = HybridDrafter(
                    NgramDrafter(max_depth=max(self.num_draft_tokens - 1, 1)), model)
        # The drafter whose KV hangs off the radix cache beside the target's (None: NGRAM).
        self.kv_drafter = None if self.algorithm == "NGRAM" else model
        self.draft_cached: Dict[str, int] = {}  # rid -> draft tokens reused at admission
        self.total_verify_ct = 0
        self.total_accepted_tokens = 0  # tokens emitted by decode steps
        self.fallback_cfg = FallbackConfig(server_args.speculative_fallback_window,
                                           server_args.speculative_fallback_threshold,
                                           server_args.speculative_reprobe_interval)
        self.controllers: Dict[str, RequestController] = {}
        self.cost_model: Optional[CostModel] = None
        if not server_args.speculative_disable_cost_model:
            self.cost_model = CostModel(self._candidate_budgets())
        self.timer = StepTimer()
        self.step_budget = 1  # the budget chosen for the current step (1 = plain)
        self.step_typical = True  # False: the step's time says little about its budget
        self.rate_prior = 0.7  # per-position acceptance over all recent requests
        self.acceptance = AcceptanceEMA(self.rate_prior, decay=0.95)
        # The draft's parameters over the target's (set by the scheduler): prices a draft
        # token from the target's prefill before any catch-up is measured.
        self.draft_share = 1.0
        # Set by the start-up calibration (calibration.py): every eligible request runs this
        # budget, fallback and the cost model's choice aside, and prompts are always warmed.
        self.forced_budget: Optional[int] = None

    def _candidate_budgets(self) -> List[int]:
        full = self.num_draft_tokens
        if self.algorithm != "NGRAM" and self.topk > 1:
            return [1, full]  # a tree's draft cost is fixed by its steps
        return sorted({1, 2, min(4, full), full})

    def depth_of(self, budget: int) -> int:
        if self.algorithm != "NGRAM":  # the draft model's levels (HYBRID's n-grams go deeper)
            return min(self.num_steps, budget - 1)
        return budget - 1

    def controller(self, req) -> RequestController:
        ctl = self.controllers.get(req.rid)
        if ctl is None:
            # A new request starts from the server's recent acceptance, not a fixed guess:
            # an optimistic prior made the cost model speculate (and re-explore budgets it
            # had ruled out) for every new request of a server whose text drafts badly.
            ctl = self.controllers[req.rid] = RequestController(self.fallback_cfg,
                                                                ema_rate=self.rate_prior)
        return ctl

    grammar_backend = None  # set by the scheduler when constrained generation is available

    @property
    def max_tree_nodes(self) -> int:
        return self.num_draft_tokens

    # ------------------------------------------------------------------ propose
    def eligible(self, req) -> bool:
        sp = req.sampling_params
        return (not req.finished
                and req.fill_len - req.kv_len == 1
                and req.max_new_tokens - len(req.output_ids) >= 2
                and sp.frequency_penalty == 0 and sp.presence_penalty == 0
                and sp.repetition_penalty == 1
                and len(req.output_ids) >= sp.min_new_tokens)

    def propose(self, reqs) -> Dict[int, DraftTree]:
        self.timer.begin()
        self.step_budget = 1
        self.step_typical = True
        forced = self.forced_budget
        cands = [r for r in reqs if self.eligible(r)
                 and (forced is not None or self.controller(r).should_speculate())]
        if not cands:
            return {}
        budget = self.num_draft_tokens
        if forced is not None:
            budget = forced
        elif self.cost_model is not None:
            budget = self.cost_model.choose([self.controller(r).ema_rate for r in cands],
                                            self.depth_of)
        if (budget > 1 and forced is None and self.cost_model is not None
                and self.kv_drafter is not None):
            cands = self._worth_catching_up(cands, budget)
            if not cands:
                budget = 1
        self.step_budget = budget
        if budget <= 1:
            return {}
        budgets = [min(budget, self.context_len - r.fill_len,
                       r.max_new_tokens - len(r.output_ids) + 1) for r in cands]
        keep = [(r, b) for r, b in zip(cands, budgets) if b >= 2]
        if not keep:
            return {}
        if self.kv_drafter is not None:
            self.kv_drafter.last_backlog = (0, 0)
        trees = self.drafter.propose([r for r, _ in keep], [b for _, b in keep],
                                     depth=self.depth_of(budget))
        if self.kv_drafter is not None:
            # A step whose draft first read a long backlog (prompts it skipped while the
            # cost model ran plain, a plain stretch) is not a typical step of its budget:
            # keep its time out of the cost model's averages. HYBRID's draft-model probes
            # (every few steps) read a few dozen tokens and stay typical.
            tokens, reqs_read = self.kv_drafter.last_backlog
            self.step_typical = tokens <= reqs_read * TYPICAL_BACKLOG
            self._price_catch_up()
        if forced is not None and any(t is None or len(t) < b for (_, b), t in zip(keep, trees)):
            # calibration: a drafter that found less to propose (n-grams) did not run the
            # forced budget, and its time would price that budget as too cheap
            self.step_typical = False
        return {id(r): t for (r, _), t in zip(keep, trees) if t is not None and len(t) > 1}

    def _worth_catching_up(self, cands, budget: int) -> list:
        """`cands` less the requests the draft is far behind on (prompts it skipped while
        plain decoding was ruled in, a fallback stretch), unless catching them up pays for
        itself over their remaining tokens (CostModel.catch_up_pays). A request left out
        decodes plainly this step and is asked again the next."""
        lag = {id(r): self.kv_drafter.backlog(r) for r in cands}
        backlog = sum(n for n in lag.values() if n > TYPICAL_BACKLOG)
        if not backlog:
            return cands
        rates = [self.controller(r).ema_rate for r in cands]
        remaining = sum(r.max_new_tokens - len(r.output_ids) for r in cands)
        if self.cost_model.catch_up_pays(rates, self.depth_of, remaining, backlog, budget):
            return cands
        return [r for r in cands if lag[id(r)] <= TYPICAL_BACKLOG]

    def _price_catch_up(self) -> None:
        """A long catch-up just ran: tell the cost model what a draft token costs."""
        tokens, seconds = self.kv_drafter.last_catch_up
        if self.cost_model is not None and tokens >= CATCH_UP_SAMPLE:
            self.cost_model.observe_catch_up(tokens, seconds)

    # ------------------------------------------------------------------ verify
    def verify(self, req, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        """logits: [len(tree), vocab] target logits at every tree node."""
        info = SamplingBatchInfo.from_reqs([req], self.vocab_size).expand_rows([len(tree)])
        adjusted = apply_logit_adjustments(logits.float(), info)
        if req.grammar is not None:
            result = self._verify_with_grammar(req, tree, adjusted, info)
            self._credit(req, result)
            return result
        if req.sampling_params.is_greedy:
            result = verify_greedy(tree, adjusted.argmax(dim=-1).tolist())
        else:
            result = verify_sampling(tree, logits_to_probs(adjusted, info), req.generator)
        self._credit(req, result)
        return result

    def _credit(self, req, result: VerifyResult) -> None:
        """HYBRID: tell the drafter which of its nodes were accepted (its weights)."""
        on_verified = getattr(self.drafter, "on_verified", None)
        if on_verified is not None:
            on_verified(req, result.path)

    def _verify_with_grammar(self, req, tree: DraftTree, adjusted: torch.Tensor,
                             info) -> VerifyResult:
        """Walk the tree with the request's matcher: each accepted node's distribution is
        masked by the grammar state after the path so far, so a drafted token the grammar
        forbids has probability 0 and is rejected. Leaves the matcher after the path and
        the bonus token."""
        matcher = req.grammar

        def row(node: int) -> torch.Tensor:
            if node:
                matcher.accept_token(tree.tokens[node])
            mask = self.grammar_backend.forbidden_mask([matcher])[0]
            return adjusted[node].masked_fill(mask, float("-inf"))

        if req.sampling_params.is_greedy:
            result = verify_greedy(tree, lambda n: int(row(n).argmax()))
        else:
            one = dataclasses.replace(info, vocab_mask=None)
            result = verify_sampling(
                tree, lambda n: logits_to_probs(row(n).unsqueeze(0), _row_info(one, n))[0],
                req.generator)
        matcher.accept_token(result.tokens[-1])
        return result

    def record(self, req, offered: int, accepted: int, emitted: int) -> None:
        """One decode-phase step of `req`: `offered` draft positions (tree depth; 0 for a
        plain step), `accepted` of them taken, `emitted` tokens appended."""
        ctl = self.controller(req)
        if offered:
            ctl.on_verify(accepted, offered, emitted)
            self.rate_prior = self.acceptance.update(accepted, offered)
        else:
            ctl.on_plain_tokens(emitted)
        req.spec_verify_ct += 1
        req.spec_accept_token_num += accepted
        hist = req.spec_accept_histogram
        while len(hist) <= accepted:
            hist.append(0)
        hist[accepted] += 1
        self.total_verify_ct += 1
        self.total_accepted_tokens += emitted

    def after_prefill(self, reqs, running=(), prefill_tokens: int = 0) -> None:
        """Requests whose prompt the target has just finished: catch the draft up on it
        now, as upstream runs the draft's extend with the target's prefill, all prompts in
        one batched catch-up. The cost lands in time to first token, where it belongs, and
        not in the first speculative step (which would also mislead the cost model's step
        times). Skipped while the cost model has ruled speculation out at the size of the
        running batch: at 16 requests it cost 11 s of TTFT for drafts never used
        (benchmark/results/adaptive_spec_sweep.json); propose catches up when needed."""
        if self.kv_drafter is None:
            return
        if self.cost_model is not None and prefill_tokens >= CATCH_UP_SAMPLE:
            # the step so far is the target's prefill forward (timer began at propose)
            self.cost_model.observe_prefill(prefill_tokens, self.timer.elapsed(),
                                            self.draft_share)
        cands = [r for r in reqs if self.eligible(r) and self.controller(r).should_speculate()]
        if not cands:
            return
        if self.cost_model is not None and running and self.forced_budget is None:
            # The batch the next decode steps will run: every running request, those whose
            # prompt is still being prefilled included (with chunked prefill, the requests
            # already decoding are a smaller batch size the cost model may not have seen).
            batch = [r for r in running
                     if not r.finished and self.controller(r).should_speculate()]
            rates = [self.controller(r).ema_rate for r in batch]
            if self.cost_model.rules_out_speculation(rates, self.depth_of):
                return
            # Short answers in a batch where speculation gains little: not worth the read.
            # (Deferring the read while plain is unmeasured at this batch size only moved
            # it into the first exploring step: cold rounds at 1 and 4 requests fell from
            # 1.10 / 1.08x to 0.70 / 0.54x of the better of plain and spec.)
            remaining = sum(r.max_new_tokens - len(r.output_ids) for r in batch)
            backlog = sum(self.kv_drafter.backlog(r) for r in cands)
            if not self.cost_model.catch_up_pays(rates, self.depth_of, remaining, backlog):
                return
        self.kv_drafter.warm_many(cands, [r.kv_len for r in cands])
        self._price_catch_up()

    def end_step(self, batch_size: int, had_prefill: bool) -> None:
        """Feed the cost model with a pure decode step's wall time."""
        if (self.cost_model is not None and batch_size and not had_prefill
                and self.step_typical):
            self.cost_model.observe(batch_size, self.step_budget, self.timer.elapsed(),
                                    calibration=self.forced_budget is not None)

    def avg_accept_length(self) -> Optional[float]:
        if not self.total_verify_ct:
            return None
        return self.total_accepted_tokens / self.total_verify_ct

    def meta_info(self, req) -> dict:
        ct = req.spec_verify_ct
        drafted = ct * (self.num_draft_tokens - 1)
        meta = {
            "spec_verify_ct": ct,
            "spec_accept_token_num": req.spec_accept_token_num,
            "spec_draft_token_num": drafted,
            "spec_accept_rate": req.spec_accept_token_num / drafted if drafted else 0.0,
            "spec_accept_length": len(req.output_ids) / ct if ct else 0.0,
            "spec_accept_histogram": list(req.spec_accept_histogram),
            "spec_fallback_count": self.controller(req).fallback_count,
        }
        if self.kv_drafter is not None:  # beside `cached_tokens`: the draft's prefix reuse
            meta["draft_cached_tokens"] = self.draft_cached.get(req.rid, 0)
        weights = getattr(self.drafter, "drafter_weights", None)
        if weights is not None:  # HYBRID: how much each drafter is trusted now
            meta["spec_drafter_weights"] = weights(req)
        return meta

    # ------------------------------------------------------------------ draft KV <-> radix cache
    @property
    def draft_allocator(self):
        """The draft KV pool's allocator (the radix cache frees draft slots into it)."""
        return None if self.kv_drafter is None else self.kv_drafter.allocator

    def attach_cache(self, tree_cache) -> None:
        """Short of draft slots, the drafter evicts the cache's unlocked draft KV (never
        target KV: draft KV goes first)."""
        if self.kv_drafter is not None:
            self.kv_drafter.evict_draft = tree_cache.evict_draft

    def adopt(self, req, match) -> None:
        """Admission: the request starts from the draft slots cached for its prefix."""
        if self.kv_drafter is None:
            return
        n = self.kv_drafter.adopt(req, match.draft_indices)
        if req.total_retractions == 0:
            self.draft_cached[req.rid] = n

    def draft_prefix(self, req) -> Optional[torch.Tensor]:
        """Draft slots of a prefix of the request's computed tokens, for cache_unfinished."""
        if self.kv_drafter is None:
            return None
        return self.kv_drafter.draft_prefix(req, req.kv_len)

    def on_cached(self, req, draft_indices: torch.Tensor, passed: int) -> None:
        if self.kv_drafter is not None:
            self.kv_drafter.on_cached(req, draft_indices, passed)

    def release(self, req) -> Optional[torch.Tensor]:
        """The request leaves the running set. Returns draft slots (a prefix of its tokens,
        at most req.kv_len) for cache_finished, which takes ownership; frees the rest.
        A prefill-only request (max_new_tokens 0) first catches the draft up on its prompt,
        so a warmed document is cached for both models."""
        if self.drafter is not self.kv_drafter:  # NGRAM, or HYBRID's n-gram side
            self.drafter.release(req)
        if self.kv_drafter is None:
            return None
        reason = req.finished_reason or {}
        if (req.max_new_tokens == 0 and reason.get("type") == "length"
                and req.kv_len == req.fill_len):
            self.kv_drafter.warm(req, req.kv_len)
        return self.kv_drafter.release(req, req.kv_len)

    def forget(self, req) -> None:
        """The request finished: drop its controller too (retraction keeps it)."""
        self.controllers.pop(req.rid, None)
        self.draft_cached.pop(req.rid, None)

    def check_all_free(self) -> None:
        self.drafter.check_all_free()


def _row_info(info: SamplingBatchInfo, row: int) -> SamplingBatchInfo:
    """The sampling parameters of one row of an expanded batch."""
    sl = slice(row, row + 1)
    return dataclasses.replace(info, temperatures=info.temperatures[sl], top_ps=info.top_ps[sl],
                               top_ks=info.top_ks[sl], min_ps=info.min_ps[sl],
                               is_greedy=info.is_greedy[sl], generators=info.generators[sl],
                               penalties=None, vocab_mask=None)
