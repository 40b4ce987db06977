"""The batch-level cost model: step times are measured online (the fastest of the recent
samples by batch size and draft budget, the draft's work included) and each step picks the
budget, "none" included, that maximises expected tokens per second; so speculation is off
where it would be slower than plain. The per-request side is `controller.py`.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.distributed.parallel_state import rank0_value
from sglang.srt.speculative.controller import expected_tokens
from sglang.srt.utils.stats import WindowedMin, batch_bucket


# A budget whose start-up (calibration) speed comes within this fraction of the best option
# gets one real step: one unlucky start-up sample must not rule it out for a whole run
# (docs/decisions.md).
CALIBRATION_MARGIN = 0.75


class CostModel:
    """Recent step time per (batch size, budget); picks the budget with the highest expected
    tokens per second. Budget 1 means plain decoding (the root only)."""

    def __init__(self, budgets: Sequence[int], window: int = 8, explore_every: int = 200,
                 min_samples: int = 2, spec_samples: int = 1, explore_first: int = 16) -> None:
        self.budgets = sorted(set(b for b in budgets if b >= 1) | {1})
        # An option's step time is the fastest of its last `window` samples: noise on a
        # shared host only ever adds time, and the recent minimum still follows a context
        # that grows (docs/decisions.md).
        self.window = window
        self.explore_every = explore_every
        # Each option is measured this many times before the model trusts it, keeping the
        # fastest sample: a one-off cost (an allocation, a draft catching up on a prompt)
        # in the only sample of an option that is then never chosen would never be corrected.
        self.min_samples = min_samples
        # A speculative budget is trusted after one sample: each costs several plain steps,
        # its usual one-off (the draft reading prompts) is kept out by the spec worker, and
        # a sample too slow only delays speculation until the periodic re-measure
        # (docs/decisions.md).
        self.spec_samples = spec_samples
        # ... and re-measured after explore_first steps, then twice as long after each sample
        # up to explore_every: one sample slowed by a busy host had kept a quoting request
        # (4x plain when speculating) off speculation for 200 steps, its whole answer.
        self.explore_first = explore_first
        self.counts: Dict[Tuple[int, int], int] = {}
        self.samples: Dict[Tuple[int, int], WindowedMin] = {}
        self.times: Dict[Tuple[int, int], float] = {}  # samples[key].value
        self.last_seen: Dict[Tuple[int, int], int] = {}
        self.calibrated: set = set()  # keys whose samples all came from the calibration
        self.step = 0
        # Seconds per token of the draft reading a backlog (prompts it skipped, a plain
        # stretch): the price of starting to speculate for a request that is behind.
        self.catch_up_samples = WindowedMin(window)
        # Before any catch-up is measured: the target's prefill seconds per token scaled
        # by the draft's share of the parameters (a draft read is a small prefill).
        self.catch_up_prior: Optional[float] = None

    _bucket = staticmethod(batch_bucket)  # 1, 2, 3, 4, 8, 16, ...

    def step_ratio(self, bs: int, budget: int) -> Optional[float]:
        """A step at `budget` over a plain step, at `bs` requests (None until both are
        measured)."""
        key = self._bucket(bs)
        spec, plain = self.times.get((key, budget)), self.times.get((key, 1))
        return spec / plain if spec is not None and plain else None

    def observe(self, bs: int, budget: int, seconds: float, calibration: bool = False) -> None:
        """A pure decode step of `bs` requests at `budget` took `seconds`. Calibration
        samples (start-up, short random prompts) stand until the first real one of their
        option, which replaces them: a real context may be dearer, and the fastest of the
        window would otherwise keep the optimistic start-up time for `window` steps."""
        key = (self._bucket(bs), budget)
        recent = self.samples.setdefault(key, WindowedMin(self.window))
        if calibration:
            self.calibrated.add(key)
        elif key in self.calibrated:
            self.calibrated.discard(key)
            recent.clear()
        recent.add(seconds)
        self.times[key] = recent.value
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last_seen[key] = self.step

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.catch_up_samples.add(seconds / tokens)

    def observe_prefill(self, tokens: int, seconds: float, draft_share: float) -> None:
        """A target prefill of `tokens` took `seconds`: prices a draft token until a real
        catch-up is measured (the fastest estimate seen)."""
        if tokens > 0:
            guess = seconds / tokens * draft_share
            self.catch_up_prior = min(guess, self.catch_up_prior or guess)

    @property
    def catch_up_token_s(self) -> Optional[float]:
        fastest = self.catch_up_samples.value
        return self.catch_up_prior if fastest is None else fastest

    def _samples(self, budget: int) -> int:
        return self.min_samples if budget <= 1 else self.spec_samples

    def _measured(self, bs: int, budget: int) -> bool:
        return self.counts.get((bs, budget), 0) >= self._samples(budget)

    def _loses_below(self, bs: int, budget: int, rates: Sequence[float], depth_of) -> bool:
        """The nearest smaller batch size where both plain and `budget` are measured found
        `budget` slower than plain for requests accepting like these: a bigger batch makes
        the verify's extra tokens dearer, not cheaper (a CPU is compute-bound), so the
        budget is not explored here."""
        smaller = [s for s in {k[0] for k in self.times}
                   if s < bs and self._measured(s, 1) and self._measured(s, budget)]
        if not smaller or not rates:
            return False
        s = max(smaller)
        per_req = self._gain(budget, rates, depth_of) / len(rates)
        return per_req / self.times[(s, budget)] < 1.0 / self.times[(s, 1)]

    @staticmethod
    def _gain(budget: int, rates: Sequence[float], depth_of) -> float:
        """Expected tokens the batch emits in one step of this budget."""
        if budget <= 1:
            return float(len(rates))
        return sum(expected_tokens(r, depth_of(budget)) for r in rates)

    def _bound(self, bs: int, budget: int, rates: Sequence[float], depth_of) -> float:
        """The most tokens/s `budget` could reach: its expected tokens over the step time of
        the dearest measured smaller budget (a bigger tree never costs less to draft and
        verify). Infinite while no smaller budget is measured."""
        lower = [self.times[(bs, b)] for b in self.budgets
                 if b < budget and self._measured(bs, b)]
        return self._gain(budget, rates, depth_of) / max(lower) if lower else float("inf")

    def _survey(self, bs: int, rates: Sequence[float], depth_of
                ) -> Tuple[int, float, Optional[int]]:
        """(best measured budget, its tokens/s, the cheapest unmeasured budget that may
        still beat it or None). Read-only."""
        best, best_speed = 1, -1.0
        for b in self.budgets:
            if self._measured(bs, b):
                speed = self._gain(b, rates, depth_of) / self.times[(bs, b)]
                if speed > best_speed:
                    best, best_speed = b, speed
        for b in self.budgets:  # ascending: the cheapest unmeasured option that may win
            if (not self._measured(bs, b) and self._bound(bs, b, rates, depth_of) > best_speed
                    and not self._loses_below(bs, b, rates, depth_of)):
                return best, best_speed, b
        for b in self.budgets:  # then a close start-up time, once, on real text
            if ((bs, b) in self.calibrated and b != best
                    and self._gain(b, rates, depth_of) / self.times[(bs, b)]
                    >= CALIBRATION_MARGIN * best_speed):
                return best, best_speed, b
        return best, best_speed, None

    def open_budgets(self, bs: int, rates: Sequence[float], depth_of) -> List[int]:
        """Speculative budgets that may still beat plain decoding at batch size `bs`: faster
        than plain when measured, else not found losing at a smaller batch and bounded above
        plain (any bound while plain is unmeasured here)."""
        plain = (self._gain(1, rates, depth_of) / self.times[(bs, 1)]
                 if self._measured(bs, 1) else None)
        open_ = []
        for b in self.budgets:
            if b <= 1:
                continue
            if self._measured(bs, b):
                speed = self._gain(b, rates, depth_of) / self.times[(bs, b)]
            elif self._loses_below(bs, b, rates, depth_of):
                continue
            else:
                speed = self._bound(bs, b, rates, depth_of)
            if plain is None or speed > plain:
                open_.append(b)
        return open_

    def catch_up_pays(self, rates: Sequence[float], depth_of, remaining: int, backlog: int,
                      budget: Optional[int] = None) -> bool:
        """Is it worth having the draft read `backlog` tokens it is behind on, so that the
        batch can speculate at `budget` (None: the most promising speculative budget) for
        its `remaining` tokens? Yes when the time speculation saves over those tokens (at
        the budget's measured speed, or its optimistic bound while unmeasured) exceeds the
        catch-up's (seconds per draft token, measured). Unknown plain speed or catch-up
        price: yes (the first catch-up measures it), unless every budget was found losing
        at a smaller batch. Why: a catch-up can cost many plain steps to measure a budget
        that saves nothing on the few tokens left (docs/decisions.md)."""
        if backlog <= 0 or not rates:
            return True
        bs = self._bucket(len(rates))
        options = [budget] if budget is not None else self.open_budgets(bs, rates, depth_of)
        if not options:
            return False
        per_token = self.catch_up_token_s
        if per_token is None or not self._measured(bs, 1):
            return True
        plain = self._gain(1, rates, depth_of) / self.times[(bs, 1)]
        speed = max(self._gain(b, rates, depth_of) / self.times[(bs, b)]
                    if self._measured(bs, b) else self._bound(bs, b, rates, depth_of)
                    for b in options)
        if speed <= plain:
            return False
        saved = remaining / plain - remaining / speed
        return saved > backlog * per_token

    def rules_out_speculation(self, rates: Sequence[float], depth_of) -> bool:
        """True when no budget may beat plain decoding at this batch size (measured slower,
        bounded below it, or found losing at a smaller batch): choose() would not speculate
        short of its occasional re-measure. Read-only (no step counted)."""
        if not rates:
            return False
        return not self.open_budgets(self._bucket(len(rates)), rates, depth_of)

    def choose(self, rates: Sequence[float], depth_of) -> int:
        """Budget for this step; `depth_of(budget)` is the tree depth a budget gives.

        Exploration goes up from plain decoding, one budget at a time, and skips a budget
        that cannot win even at the cost of the measured smaller ones: where a speculative
        step costs several plain ones, measuring every budget is a large share of a short
        answer (docs/decisions.md)."""
        self.step += 1
        bs = self._bucket(len(rates))
        best, best_speed, explore = self._survey(bs, rates, depth_of)
        if explore is not None:
            return explore
        # Timings drift (the context grows): now and then re-measure the option seen least
        # recently among those that may still win.
        open_ = [b for b in self.budgets if b == best or (
            self._measured(bs, b) and self._bound(bs, b, rates, depth_of) > best_speed)]
        due = [b for b in open_ if self.step - self.last_seen[(bs, b)] > self._wait(bs, b)]
        if due:
            return min(due, key=lambda b: self.last_seen[(bs, b)])
        return best

    def _wait(self, bs: int, budget: int) -> int:
        """Steps before an option not chosen is measured again: explore_every, sooner for a
        speculative budget with few samples (a windowed minimum of many shrugs off a slow
        one; a single slow sample is all a rarely measured option has)."""
        if budget <= 1:
            return self.explore_every
        n = self.counts.get((bs, budget), 1)
        return min(self.explore_every, self.explore_first << min(n - 1, 16))


class StepTimer:
    """Wall time of one scheduler step, attributed to the cost model when it was a pure
    decode/speculate step (prefill chunks would distort the per-budget averages)."""

    def __init__(self) -> None:
        self.start = 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return rank0_value(time.perf_counter() - self.start)  # alike on every TP rank
