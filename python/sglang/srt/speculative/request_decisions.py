"""Per-request speculation decisions: each request's fallback controller, the draft length it
asks for, and what its verifies cost in plain steps (the price its fallback window weighs).

Kept per request, never shared: the same request gets the same decisions in a fresh server
and after others when its own acceptance is the same (issue 28). The step's orchestration is
`spec_worker.py`; the rules themselves are `controller.py`.
"""

from __future__ import annotations

from typing import Dict, Optional

from sglang.srt.speculative.config import SpecConfig
from sglang.srt.speculative.controller import RequestController, expected_tokens

# A verify step of `rows` rows over a plain step, for a drafter that costs nothing, until the
# cost model has measured both at the batch size: 1 + 0.12 per extra row, a fit of
# benchmark/results/verify_cost.json (0.5B bf16, 1K-16K context; docs/decisions.md)
VERIFY_ROW_COST = 0.12


# A draft-model request's prior acceptance counts as this many decided positions (a free
# drafter's, whose verifies cost little, stands for a whole history: controller.AcceptanceEMA)
DRAFT_MODEL_PRIOR_WEIGHT = 1.0


def verify_cost_prior(rows: int) -> float:
    return 1.0 + VERIFY_ROW_COST * max(rows - 1, 0)


class RequestDecisions:
    """rid -> RequestController, created on a request's first step and dropped when it
    finishes (a retracted request keeps its own)."""

    def __init__(self, cfg: SpecConfig, drafter) -> None:
        self.cfg, self.drafter = cfg, drafter
        self.controllers: Dict[str, RequestController] = {}
        # verifies judged by their price in plain steps (free drafters, HYBRID's n-grams);
        # else by the acceptance threshold
        self.prices_verifies = drafter.costs_nothing or drafter.drafts_without_model

    def controller(self, req) -> RequestController:
        ctl = self.controllers.get(req.rid)
        if ctl is None:
            full = self.cfg.num_draft_tokens - 1
            if self.drafter.costs_nothing:
                # its own acceptance from a fixed prior, its own draft length (trying costs
                # a free drafter next to nothing)
                ctl = RequestController(self.cfg.fallback)
                ctl.max_draft_len = ctl.draft_len = full
            else:  # the same fixed prior and first-step probe (docs/decisions.md)
                ctl = RequestController(self.cfg.fallback,
                                        can_drop_model=self.drafter.drafts_without_model)
                if self.drafter.drafts_without_model:
                    # HYBRID: its n-grams alone (model off) size their draft as NGRAM does
                    ctl.max_draft_len = ctl.draft_len = full
                else:  # a draft model or head alone: its own acceptance from its first verifies
                    ctl.prior_weight = DRAFT_MODEL_PRIOR_WEIGHT
            self.controllers[req.rid] = ctl
        return ctl

    def own_budget(self, req, budget: int, model_sits_out: bool = False) -> int:
        """The request's own draft length, plus the root: free drafters size it per request,
        HYBRID while its draft model sits out for the request (its n-grams alone: the model
        off for it, or held back this step); a draft model's tree keeps the step's budget."""
        ctl = self.controller(req)
        alone = ctl.model_off or (model_sits_out and self.drafter.drafts_without_model)
        own = ctl.draft_len if self.drafter.costs_nothing or alone else 0
        return own + 1 if own else budget

    def price(self, req, offered: int, break_even: Optional[float]) -> Optional[float]:
        """What a verify of `offered` positions cost in plain steps, for the fallback window:
        a free drafter's by the step's measured cost (`break_even`, else the tree's own rows);
        HYBRID's with its draft model at least the seed's rule at the model's depth (its
        steps' cost); None for a draft model (judged by the acceptance threshold)."""
        if not self.prices_verifies:
            return None
        price = break_even or verify_cost_prior(offered + 1)
        if self.drafter.model_ran_for(req):
            depth = min(self.cfg.num_steps, offered)
            price = max(price, expected_tokens(self.cfg.fallback.threshold, depth))
        return price

    def forget(self, rid: str) -> None:
        self.controllers.pop(rid, None)
