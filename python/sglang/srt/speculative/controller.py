"""When to speculate: a per-request fallback controller and a batch-level cost model.

Per request, over the last `window` offered draft positions, speculation must pay: the
tokens a verify emits must exceed what the verify costs in plain steps. Two forms of it:
- a drafter that costs nothing to run (n-grams): tokens per verify against the measured
  cost of a verify step over a plain one (`break_even`, from the cost model);
- a draft model: the seed's rule, acceptance per offered position >= `threshold` (0.5).
  It stands for the same test with the draft's cost in the price: at 0.5 a chain of d
  drafts emits (1 - 0.5^(d+1)) / 0.5 tokens a verify (1.9 for d = 3), about what a step
  that runs the draft d times and the verify costs in plain steps.
A verify may carry its own price in plain steps (`break_even`); a window holding priced
verifies pays when the tokens it emitted reach the sum of their prices (an unpriced one is
priced by the seed's rule at its depth). HYBRID prices each verify by whether its draft
model ran for the request, and falls back in two stages: first from the draft model to its
n-grams alone (`model_off`, for `reprobe_interval` tokens, doubling), then to plain decoding;
n-grams that pay are never switched off because the model beside them did not.
Below it the request decodes plainly; after `reprobe_interval` plain tokens it speculates
again for one window (a probe); a failed probe doubles the wait (back-off, capped), a good
one returns to speculation. Each request also sizes its own draft (`draft_len`): it doubles
after a verify that took every drafted token and halves towards what was accepted after a
rejection, so a passage being quoted gets long chains and free prose short ones.

Per batch (`cost_model.py`): step times are measured online and each step picks the budget,
"none" included, that maximises expected tokens per second.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Deque, List, Optional, Tuple

from sglang.srt.utils.stats import ema

logger = logging.getLogger(__name__)

SPEC, PLAIN, PROBE = "spec", "plain", "probe"
PRIOR_RATE = 0.7  # per-position acceptance assumed before any verify
MAX_BACKOFF = 16
# A request's first decode steps are weighed at an optimistic acceptance (at least
# PROBE_RATE) so that it is measured on its own text wherever a well-drafted request would
# pay: priors shared between requests had kept a quoting request (1.34x plain when it
# speculated) from ever speculating after others drafted badly (docs/decisions.md).
PROBE_STEPS = 2  # verifies weighed at PROBE_RATE
PROBE_RATE = 0.9
PROBE_WAIT = 4  # plain steps (in all) before the probe's verifies are done: it ends then


@dataclasses.dataclass
class FallbackConfig:
    """--speculative-fallback-window / -threshold, --speculative-reprobe-interval."""

    window: int
    threshold: float
    reprobe_interval: int


@dataclasses.dataclass
class RequestController:
    """Fallback state of one request (all counts are draft positions or tokens)."""

    cfg: FallbackConfig
    mode: str = SPEC
    # per verify in the window: (accepted, offered, emitted, price in plain steps or None)
    outcomes: Deque[Tuple[int, int, int, Optional[float]]] = dataclasses.field(
        default_factory=collections.deque)
    offered: int = 0  # positions in the window
    accepted: int = 0
    emitted: int = 0  # tokens the window's verifies emitted
    # HYBRID: the draft model can sit out while the n-grams go on (`model_off`); it is
    # asked again after `model_left` tokens, a wait that doubles after each failed window
    can_drop_model: bool = False
    model_off: bool = False
    model_left: int = 0
    model_backoff: int = 1
    draft_len: int = 0  # drafted tokens this request asks for (0: no limit of its own)
    max_draft_len: int = 0
    plain_left: int = 0
    backoff: int = 1
    fallback_count: int = 0
    ema_rate: float = PRIOR_RATE  # per-position acceptance, for the cost model
    # its parts: recent accepted positions over recent decided positions (AcceptanceEMA)
    acceptance: Optional["AcceptanceEMA"] = None
    # the prior's weight in decided positions (None: a whole history; AcceptanceEMA): a
    # draft model's request, whose verifies cost several plain steps each, learns its own
    # acceptance from its first verifies (docs/decisions.md)
    prior_weight: Optional[float] = None
    switches: List[Tuple[int, str]] = dataclasses.field(default_factory=list)
    tokens_seen: int = 0
    probe_left: int = PROBE_STEPS  # verifies still weighed at PROBE_RATE
    probe_wait: int = PROBE_WAIT  # plain steps the probe still waits for its verifies

    def should_speculate(self) -> bool:
        return self.mode in (SPEC, PROBE)

    def decision_rate(self) -> float:
        """The acceptance the cost model weighs this request by: its own estimate, and at
        least PROBE_RATE until its first PROBE_STEPS verifies (a step the draft could not
        run, e.g. a catch-up that did not pay, leaves the probe for the next, up to
        PROBE_WAIT plain steps in all: then speculation loses even at PROBE_RATE)."""
        return max(self.ema_rate, PROBE_RATE) if self.probe_left > 0 else self.ema_rate

    def rate(self) -> float:
        return self.accepted / self.offered if self.offered else 1.0

    def pays(self) -> bool:
        """Does speculation beat plain decoding over the window?"""
        if all(o[3] is None for o in self.outcomes):
            return self.rate() >= self.cfg.threshold
        price = sum(p if p is not None else expected_tokens(self.cfg.threshold, o)
                    for _, o, _, p in self.outcomes)
        return self.emitted >= price

    def on_verify(self, accepted: int, offered: int, emitted: int,
                  break_even: Optional[float] = None) -> None:
        """A verify offered `offered` positions, `accepted` were taken, `emitted` tokens
        appended; `break_even`: what this verify cost in plain steps (None: unpriced)."""
        self.tokens_seen += emitted
        self._count_model_wait(emitted)
        if offered <= 0:
            return
        self.probe_left = max(self.probe_left - 1, 0)
        if self.acceptance is None:
            self.acceptance = AcceptanceEMA(self.ema_rate, decay=0.8,
                                            prior_weight=self.prior_weight)
        self.ema_rate = self.acceptance.update(accepted, offered)
        self._size_draft(accepted, offered)
        self.outcomes.append((accepted, offered, emitted, break_even))
        self.offered += offered
        self.accepted += accepted
        self.emitted += emitted
        # Slide: keep the most recent positions that still cover a whole window.
        while self.outcomes and self.offered - self.outcomes[0][1] >= self.cfg.window:
            a, o, e, _ = self.outcomes.popleft()
            self.offered -= o
            self.accepted -= a
            self.emitted -= e
        if self.offered < self.cfg.window:
            return
        if self.cfg.threshold <= 0:  # --speculative-fallback-threshold 0: never fall back
            return
        pays = self.pays()
        if pays and not self.model_off:
            self.model_backoff = 1
        if not pays and self.can_drop_model and not self.model_off:
            self._drop_model()  # the n-grams alone get a window before plain decoding
        elif self.mode == SPEC and not pays:
            self._fall_back()
        elif self.mode == PROBE:
            if pays:
                self.backoff = 1
                self._switch(SPEC)
            else:
                self.backoff = min(self.backoff * 2, MAX_BACKOFF)
                self._fall_back()

    def _drop_model(self) -> None:
        self.model_off = True
        self.model_left = self.cfg.reprobe_interval * self.model_backoff
        self.model_backoff = min(self.model_backoff * 2, MAX_BACKOFF)
        self._reset_window()
        logger.debug("draft model off at token %d for %d tokens", self.tokens_seen,
                     self.model_left)

    def _count_model_wait(self, n: int) -> None:
        if not self.model_off:
            return
        self.model_left -= n
        if self.model_left <= 0:  # ask the draft model again: its own window judges it
            self.model_off = False
            if self.mode != PLAIN:
                self._reset_window()

    def on_plain_tokens(self, n: int) -> None:
        self.tokens_seen += n
        if self.probe_left:
            self.probe_wait -= 1
            self.probe_left = self.probe_left if self.probe_wait > 0 else 0
        self._count_model_wait(n)
        if self.mode != PLAIN:
            return
        self.plain_left -= n
        if self.plain_left <= 0:
            self._reset_window()
            self._switch(PROBE)

    def _fall_back(self) -> None:
        self.fallback_count += 1
        self.plain_left = self.cfg.reprobe_interval * self.backoff
        self._reset_window()
        self._switch(PLAIN)

    def _size_draft(self, accepted: int, offered: int) -> None:
        if not self.max_draft_len:
            return
        if accepted >= offered:  # every drafted token taken: ask for more
            self.draft_len = min(self.max_draft_len, 2 * max(self.draft_len, 1))
        else:  # halve towards what was accepted
            self.draft_len = max(1, (self.draft_len + accepted + 1) // 2)

    def _reset_window(self) -> None:
        self.outcomes.clear()
        self.offered = self.accepted = self.emitted = 0

    def _switch(self, mode: str) -> None:
        logger.debug("speculation %s -> %s at token %d (rate %.2f)", self.mode, mode,
                     self.tokens_seen, self.rate())
        self.mode = mode
        self.switches.append((self.tokens_seen, mode))


def decided_positions(accepted: int, offered: int) -> int:
    """Draft positions a verify decided: every accepted one and the first rejected; those
    after a rejection were never tested."""
    return accepted + (1 if accepted < offered else 0)


class AcceptanceEMA:
    """Per-position acceptance probability, the `rate` expected_tokens() takes: decayed
    accepted positions over decayed decided ones. Accepted over offered (what the fallback
    window counts) is biased low for a chain, and underrated speculation (docs/decisions.md).

    `prior_weight`: how many decided positions the prior counts as. None: 1 / (1 - decay),
    what a moving average started at the prior gives it (a whole history: a request's first
    verifies move it by 1 - decay each); 1: a request's own first verifies outweigh it at
    once. Either way the estimate forgets at `decay` a verify."""

    def __init__(self, prior: float, decay: float, prior_weight: Optional[float] = None) -> None:
        self.decay = decay
        # in units of the moving average (weights scaled by 1 - decay)
        weight = 1.0 if prior_weight is None else prior_weight * (1 - decay)
        self.hits, self.trials = prior * weight, weight

    def update(self, accepted: int, offered: int) -> float:
        self.hits = ema(self.hits, accepted, self.decay)
        self.trials = ema(self.trials, decided_positions(accepted, offered), self.decay)
        return self.rate

    @property
    def rate(self) -> float:
        return self.hits / self.trials if self.trials > 0 else 0.0


def expected_tokens(rate: float, depth: int) -> float:
    """Tokens one verify emits for a chain of `depth` drafts with per-position acceptance
    `rate` (accepted prefix + the bonus token)."""
    rate = min(max(rate, 0.0), 0.999)
    return (1 - rate ** (depth + 1)) / (1 - rate)
