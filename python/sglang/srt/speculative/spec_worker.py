"""SpecWorker: orchestrates one speculative step for the scheduler.

A step: `propose` picks the requests that speculate and the budget (a `BudgetPolicy`), and
asks the drafter for trees -> the scheduler runs the target's verify pass -> `verify` picks
each request's accepted path -> `record` feeds the fallback controller and the cost model.
Memory and batching stay in the scheduler; acceptance math lives in verify.py; the draft's
KV seam with the radix cache is `drafter.draft_kv` (drafters/base.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Dict, List, Optional

import torch

from sglang.srt.speculative.budget_policy import BudgetPolicy, CostModelBudget
from sglang.srt.speculative.config import SpecConfig
from sglang.srt.speculative.controller import PRIOR_RATE, AcceptanceEMA, RequestController
from sglang.srt.speculative.cost_model import CostModel, StepTimer
from sglang.srt.speculative.drafters import build_drafter
from sglang.srt.speculative.request_decisions import RequestDecisions
from sglang.srt.speculative.tree import DraftTree
from sglang.srt.speculative.verify import VerifyResult
from sglang.srt.speculative.verify_batch import greedy_targets, verify_tree

logger = logging.getLogger(__name__)

TYPICAL_BACKLOG = 64  # draft catch-up tokens per request beyond which a step is atypical
CATCH_UP_SAMPLE = 64  # catch-ups of at least this many tokens price a draft token


@dataclasses.dataclass
class Proposal:
    """What `propose` decided for one step."""

    trees: List[Optional[DraftTree]]  # per request asked, None: it decodes plainly
    budget: int = 1  # tree nodes per request chosen for the step (1 = plain)
    typical: bool = True  # False: the step's time says little about its budget
    break_even: Optional[float] = None  # measured: tokens per verify that pay for the step


@dataclasses.dataclass
class LearnedState:
    """What traffic teaches the worker; the calibration puts it back as it found it."""

    rate_prior: float
    acceptance: AcceptanceEMA
    total_verify_ct: int
    total_accepted_tokens: int
    catch_up_samples: List[float]
    catch_up_prior: Optional[float]


class SpecWorker:
    def __init__(self, server_args, vocab_size: int, max_running: int, context_len: int,
                 max_total_tokens: int, chunk_size: int, target_params: int = 0,
                 grammar_backend=None) -> None:
        self.cfg = cfg = SpecConfig.from_server_args(server_args)
        self.algorithm = cfg.algorithm
        self.num_steps, self.topk, self.num_draft_tokens = (cfg.num_steps, cfg.topk,
                                                            cfg.num_draft_tokens)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.drafter = build_drafter(cfg, server_args, max_running, context_len,
                                     max_total_tokens, chunk_size)
        self.draft_kv = self.drafter.draft_kv  # NO_DRAFT_KV for n-grams
        self.draft_cached: Dict[str, int] = {}  # rid -> draft tokens reused at admission
        self.total_verify_ct = 0
        self.total_accepted_tokens = 0  # tokens emitted by decode steps
        self.decisions = RequestDecisions(cfg, self.drafter)  # per request, never shared
        self.cost_model = CostModel(self._candidate_budgets()) if cfg.cost_model else None
        self.default_policy = CostModelBudget(self.cost_model, self.num_draft_tokens)
        self.policy: BudgetPolicy = self.default_policy
        self.timer = StepTimer()
        self.proposal = Proposal([])
        self.rate_prior = PRIOR_RATE  # per-position acceptance over all recent requests
        self.acceptance = AcceptanceEMA(self.rate_prior, decay=0.95)
        # The draft's parameters over the target's: prices a draft token from the target's
        # prefill before any catch-up is measured.
        self.draft_share = (self.draft_kv.num_params / target_params
                            if self.draft_kv.enabled and target_params else 1.0)
        self.grammar_backend = grammar_backend  # masks drafted tokens a grammar forbids

    def _candidate_budgets(self) -> List[int]:
        full = self.num_draft_tokens
        if self.cfg.uses_draft_model and self.topk > 1:
            return [1, full]  # a tree's draft cost is fixed by its steps
        return sorted({1, 2, min(4, full), full})

    def depth_of(self, budget: int) -> int:
        if self.cfg.uses_draft_model and not self.drafter.drafts_without_model:
            return min(self.num_steps, budget - 1)  # the draft model's levels
        # n-grams (HYBRID's too) fill the budget's depth; the draft model stops at its steps
        return budget - 1

    def catch_up_depth(self, budget: int) -> int:
        """The tree depth a draft catch-up buys: the draft model's levels. HYBRID's n-grams
        fill the rest of the depth with no draft KV at all, so reading a prompt for its
        model is worth only the model's steps (priced at budget - 1, a 1K prompt was read
        for 64-token answers the n-grams alone quoted: TTFT +1.6 s, docs/decisions.md)."""
        if self.drafter.drafts_without_model:
            return min(self.num_steps, budget - 1)
        return self.depth_of(budget)

    def controller(self, req) -> RequestController:
        return self.decisions.controller(req)

    @property
    def controllers(self) -> Dict[str, RequestController]:
        return self.decisions.controllers

    @property
    def prices_verifies(self) -> bool:
        return self.decisions.prices_verifies

    # ------------------------------------------------------------------ the target's features
    def bind_target(self, runner) -> None:
        """The target is built (an EAGLE-3 head shares its embedding)."""
        self.drafter.bind_target(runner.model, runner.config)

    @property
    def capture_layers(self) -> Optional[List[int]]:
        """Target layers every target forward hands the drafter (None: none)."""
        return self.drafter.target_layers()

    def take_hidden(self, plan) -> None:
        """Hand the drafter the features of what each request's forward kept: a prompt
        chunk's or a decode's rows, a verify's accepted path (its rows, root first)."""
        offset = 0
        for it in plan.items:
            rows = plan.captured[offset: offset + it.num_tokens]
            offset += it.num_tokens
            if it.tree is not None:
                kept = it.kept or [0]
                rows = rows[torch.tensor(kept, dtype=torch.int64, device=rows.device)]
            self.drafter.on_target_hidden(it.req, it.req.kv_len - len(rows), rows)

    @property
    def max_tree_nodes(self) -> int:
        return self.num_draft_tokens

    def use_policy(self, policy: Optional[BudgetPolicy]) -> None:
        """Run `policy` from the next step on (None: back to the cost model's)."""
        self.policy = policy or self.default_policy

    # ------------------------------------------------------------------ propose
    def eligible(self, req) -> bool:
        sp = req.sampling_params
        return (not req.finished
                and req.fill_len - req.kv_len == 1
                and req.max_new_tokens - len(req.output_ids) >= 2
                and sp.frequency_penalty == 0 and sp.presence_penalty == 0
                and sp.repetition_penalty == 1
                and len(req.output_ids) >= sp.min_new_tokens)

    def propose(self, reqs) -> Proposal:
        """Trees for the decoding `reqs` (None for those that decode plainly this step)."""
        self.timer.begin()
        self.proposal = self._propose(reqs)
        return self.proposal

    def _propose(self, reqs) -> Proposal:
        policy = self.policy
        none = Proposal([None] * len(reqs))
        cands = [r for r in reqs if self.eligible(r)
                 and (policy.forced or self.controller(r).should_speculate())]
        if not cands:
            return none
        budget = policy.choose([self.controller(r).decision_rate() for r in cands], self.depth_of)
        held: set = set()
        if budget > 1 and not policy.forced and self.cost_model is not None:
            kept = self._worth_catching_up(cands, budget)
            if self.drafter.drafts_without_model:  # the rest are drafted without the model
                held = {r.rid for r in cands} - {r.rid for r in kept}
            else:
                cands = kept
                budget = budget if cands else 1
        alone = None  # HYBRID: what its n-grams alone may fill (the model adds its levels)
        if self.drafter.drafts_without_model and not policy.forced:
            held |= {r.rid for r in cands if self.controller(r).model_off}
            alone = {r.rid: self._request_budget(r, budget, True) for r in cands}
        self.drafter.hold_back(held, alone)
        none.budget = budget
        budgets = [self._request_budget(r, budget, r.rid in held) for r in cands]
        keep = [(r, b) for r, b in zip(cands, budgets) if b >= 2]
        if budget <= 1 or not keep:
            return none
        self.draft_kv.begin_proposal()
        trees = self.drafter.propose([r for r, _ in keep], [b for _, b in keep],
                                     depth=self.depth_of(budget))
        # a step whose draft first read a long backlog is not a typical step of its budget
        read = self.draft_kv.last_read()
        typical = read.backlog_tokens <= read.requests * TYPICAL_BACKLOG
        self._price_catch_up()
        if policy.forced and any(t is None or len(t) < b for (_, b), t in zip(keep, trees)):
            typical = False  # a drafter that found less did not run the forced budget
        by_rid = {r.rid: t for (r, _), t in zip(keep, trees) if t is not None and len(t) > 1}
        if not by_rid:  # nothing drafted: a plain step, and timed as one if no model ran
            ran = any(self.drafter.model_ran_for(r) for r, _ in keep)
            timed_plain = not ran and not policy.forced
            return Proposal(none.trees, 1 if timed_plain else budget, typical and timed_plain)
        return Proposal([by_rid.get(r.rid) for r in reqs], budget, typical,
                        self._break_even(len(reqs), budget))

    def _request_budget(self, r, budget: int, model_sits_out: bool) -> int:
        own = budget if self.policy.forced else self.decisions.own_budget(r, budget, model_sits_out)
        return min(budget, own, self.context_len - r.fill_len,
                   r.max_new_tokens - len(r.output_ids) + 1)

    def _break_even(self, batch_size: int, budget: int) -> Optional[float]:
        """Tokens per verify at which this step's speculation is as fast as plain decoding,
        for a drafter that costs nothing (or HYBRID's n-grams): the verify step's measured
        cost in plain steps."""
        if not self.prices_verifies or self.cost_model is None:
            return None
        return self.cost_model.step_ratio(batch_size, budget)

    def _worth_catching_up(self, cands, budget: int) -> list:
        """`cands` less the requests the draft is far behind on, unless catching them up
        pays for itself over their remaining tokens (CostModel.catch_up_pays). A request
        left out decodes plainly this step and is asked again the next."""
        lag = [self.draft_kv.backlog(r) for r in cands]
        backlog = sum(n for n in lag if n > TYPICAL_BACKLOG)
        if not backlog:
            return cands
        rates = [self.controller(r).decision_rate() for r in cands]
        remaining = sum(r.max_new_tokens - len(r.output_ids) for r in cands)
        if self.cost_model.catch_up_pays(rates, self.catch_up_depth, remaining, backlog,
                                         budget):
            return cands
        return [r for r, n in zip(cands, lag) if n <= TYPICAL_BACKLOG]

    def _price_catch_up(self) -> None:
        """A long catch-up just ran: tell the cost model what a draft token costs."""
        read = self.draft_kv.last_read()
        if self.cost_model is not None and read.computed_tokens >= CATCH_UP_SAMPLE:
            self.cost_model.observe_catch_up(read.computed_tokens, read.seconds)

    # ------------------------------------------------------------------ verify
    def greedy_targets(self, trees) -> Dict[str, List[int]]:
        """(req, tree, logits) per verify of the step -> every greedy tree's target argmax
        per node, read from the device once for all (verify_batch.py)."""
        return greedy_targets(trees, self.vocab_size)

    def verify(self, req, tree: DraftTree, logits: torch.Tensor,
               target_ids: Optional[List[int]] = None) -> VerifyResult:
        """logits: [len(tree), vocab] target logits at every tree node; target_ids: a greedy
        request's argmax per node when `greedy_targets` already read them."""
        result = verify_tree(req, tree, logits, self.vocab_size, self.grammar_backend,
                             target_ids)
        self.drafter.on_verified(req, result.path)
        return result

    def record(self, req, offered: int, accepted: int, emitted: int) -> None:
        """One decode-phase step of `req`: `offered` draft positions (tree depth; 0 for a
        plain step), `accepted` of them taken, `emitted` tokens appended."""
        ctl = self.controller(req)
        if offered:
            ctl.on_verify(accepted, offered, emitted,
                          self.decisions.price(req, offered, self.proposal.break_even))
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
        """Requests whose prompt the target has just finished: catch the draft up on them
        now, in one batched catch-up (as upstream runs the draft's extend with the target's
        prefill), so the cost lands in time to first token. Skipped where the cost model
        rules speculation out at the running batch size (docs/decisions.md)."""
        if not self.draft_kv.enabled:
            return
        if self.cost_model is not None and prefill_tokens >= CATCH_UP_SAMPLE:
            # the step so far is the target's prefill forward (timer began at propose)
            self.cost_model.observe_prefill(prefill_tokens, self.timer.elapsed(),
                                            self.draft_share)
        cands = [r for r in reqs if self.eligible(r) and self.controller(r).should_speculate()]
        if not cands:
            return
        if self.cost_model is not None and running and not self.policy.forced:
            # the batch the next decode steps run, prompts still prefilling included
            batch = [r for r in running
                     if not r.finished and self.controller(r).should_speculate()]
            rates = [self.controller(r).decision_rate() for r in batch]
            if self.cost_model.rules_out_speculation(rates, self.depth_of):
                return
            remaining = sum(r.max_new_tokens - len(r.output_ids) for r in batch)
            backlog = sum(self.draft_kv.backlog(r) for r in cands)
            if not self.cost_model.catch_up_pays(rates, self.catch_up_depth, remaining,
                                                 backlog):
                return  # short answers where speculation gains little: not worth the read
        self.draft_kv.warm_many(cands, [r.kv_len for r in cands])
        self._price_catch_up()

    def end_step(self, batch_size: int, had_prefill: bool) -> None:
        """Feed the cost model with a pure decode step's wall time."""
        if (self.cost_model is not None and batch_size and not had_prefill
                and self.proposal.typical):
            self.cost_model.observe(batch_size, self.proposal.budget, self.timer.elapsed(),
                                    calibration=self.policy.forced)

    # ------------------------------------------------------------------ figures
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
        if self.draft_kv.enabled:  # beside `cached_tokens`: the draft's prefix reuse
            meta["draft_cached_tokens"] = self.draft_cached.get(req.rid, 0)
        weights = self.drafter.weights_of(req)
        if weights is not None:  # HYBRID: how much each drafter is trusted now
            meta["spec_drafter_weights"] = weights
        return meta

    def learned_state(self) -> LearnedState:
        cm = self.cost_model
        return LearnedState(self.rate_prior, copy.copy(self.acceptance), self.total_verify_ct, self.total_accepted_tokens,
                            list(cm.catch_up_samples) if cm else [],
                            cm.catch_up_prior if cm else None)

    def restore_learned_state(self, state: LearnedState) -> None:
        self.rate_prior, self.acceptance = state.rate_prior, state.acceptance
        self.total_verify_ct = state.total_verify_ct
        self.total_accepted_tokens = state.total_accepted_tokens
        if self.cost_model is not None:
            self.cost_model.catch_up_samples.clear()
            self.cost_model.catch_up_samples.extend(state.catch_up_samples)
            self.cost_model.catch_up_prior = state.catch_up_prior

    # ------------------------------------------------------------------ draft KV <-> radix cache
    @property
    def draft_allocator(self):
        """The draft KV pool's allocator (the radix cache frees draft slots into it)."""
        return self.draft_kv.allocator

    def attach_cache(self, tree_cache) -> None:
        """Short of draft slots, the drafter evicts the cache's unlocked draft KV (never
        target KV: draft KV goes first)."""
        self.draft_kv.set_evictor(tree_cache.evict_draft)

    def adopt(self, req, match) -> None:
        """Admission: the request starts from the draft slots cached for its prefix (a
        head's, less its `match_lag` rows that read tokens past the match). The target's
        match is plain's whatever the drafter: its prefill computes the same tokens."""
        if not self.draft_kv.enabled:
            return
        slots = match.draft_indices[: max(0, match.length - self.drafter.match_lag)]
        n = self.draft_kv.adopt(req, slots) if len(slots) else 0
        if req.total_retractions == 0:
            self.draft_cached[req.rid] = n

    def draft_prefix(self, req) -> Optional[torch.Tensor]:
        """Draft slots of a prefix of the request's computed tokens, for cache_unfinished."""
        return self.draft_kv.shareable_prefix(req, req.kv_len)

    def on_cached(self, req, draft_indices: torch.Tensor, passed: int) -> None:
        self.draft_kv.on_cached(req, draft_indices, passed)

    def release(self, req) -> Optional[torch.Tensor]:
        """The request leaves the running set. Returns draft slots (a prefix of its tokens,
        at most req.kv_len) for cache_finished, which takes ownership; frees the rest.
        A prefill-only request (max_new_tokens 0) first catches the draft up on its prompt,
        so a warmed document is cached for both models."""
        self.drafter.release(req)
        reason = req.finished_reason or {}
        if (self.draft_kv.enabled and req.max_new_tokens == 0
                and reason.get("type") == "length" and req.kv_len == req.fill_len):
            self.draft_kv.warm_many([req], [req.kv_len])
        return self.draft_kv.release_kv(req, req.kv_len)

    def forget(self, req) -> None:
        """The request finished: drop its controller too (retraction keeps it)."""
        self.decisions.forget(req.rid)
        self.draft_cached.pop(req.rid, None)

    def check_all_free(self) -> None:
        self.drafter.check_all_free()

