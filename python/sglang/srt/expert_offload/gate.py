"""Prefetch gate: an online A/B of expert prefetch against on-demand loads, per batch shape.

A prefetch wins time only where loads overlap other work and the bytes it adds (wrong
guesses, evictions) cost less than the stalls it hides. Where it does not (loader threads
and the draft sharing few cores and one disk: docs/decisions.md), a server should not pay
for it. So, as the speculation cost model does for draft budgets, the gate times pure
decode steps with prefetch on and off and keeps the faster:

- a key is (batch size bucket, draft budget: rows per request, 1 for plain decoding); step
  times depend on both and not on what the steps emit (prefetch never changes tokens);
- a step inherits the experts the previous step left resident, so a sample counts only
  when the previous step (same batch bucket) ran the same arm: measured in alternation, an
  on-demand step rides on the experts the prefetching step before it loaded
  (docs/decisions.md). Until each arm has `min_samples` such samples at a key, the arms run
  in blocks, prefetch first (min_samples + 1 steps each);
- then each step takes the arm with the lower recent time (fastest of the last `window`
  samples: noise on a shared host only ever adds time);
- when the other arm has not run for `explore_every` steps it is measured again, from
  scratch (a block of fresh steps: its old samples came from a shorter context or another
  disk minute); at 4 of 50 steps that costs ~2% where one arm is 20% slower.
Steps with prefill chunks are not timed and run with prefetch on (as configured).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from sglang.srt.utils.stats import WindowedMin
from sglang.srt.utils.stats import batch_bucket as bucket  # the cost model's buckets

__all__ = ["ON", "OFF", "PrefetchGate", "bucket"]

ON, OFF = True, False
Key = Tuple[int, int]


@dataclasses.dataclass
class _Arm:
    samples: WindowedMin  # step seconds that inherited this arm's residency
    steps: int = 0  # steps this arm ran at the key (timed)
    last_step: int = -1

    def best(self) -> Optional[float]:
        return self.samples.value


class PrefetchGate:
    def __init__(self, window: int = 8, min_samples: int = 3, explore_every: int = 50) -> None:
        self.window, self.min_samples, self.explore_every = window, min_samples, explore_every
        self.arms: Dict[Key, Dict[bool, _Arm]] = {}
        self.budget_of: Dict[int, int] = {}  # bucket -> draft budget of its last timed step
        self.last_arm: Dict[int, bool] = {}  # bucket -> arm of its latest step
        self._inherits = False  # the step under way follows a step of the same arm
        self.step = 0
        self.chosen = {ON: 0, OFF: 0}  # pure decode steps run with each arm

    def _arms(self, key: Key) -> Dict[bool, _Arm]:
        if key not in self.arms:
            self.arms[key] = {arm: _Arm(WindowedMin(self.window))
                              for arm in (ON, OFF)}
        return self.arms[key]

    def choose(self, batch_size: int) -> bool:
        """Prefetch in this pure decode step of `batch_size` requests? (The draft budget is
        chosen later in the step: the bucket's last one stands in for it.)"""
        self.step += 1
        b = bucket(batch_size)
        arms = self._arms((b, self.budget_of.get(b, 1)))
        short = [arm for arm in (ON, OFF) if len(arms[arm].samples) < self.min_samples]
        prev = self.last_arm.get(b)
        if short:  # measuring: the block under way, else the arm with fewer samples
            arm = prev if prev in short else min(
                short, key=lambda a: (len(arms[a].samples), a is OFF))
        else:
            arm = ON if arms[ON].best() <= arms[OFF].best() else OFF
            other = arms[not arm]
            if self.step - other.last_step > self.explore_every:
                # re-measure the other arm on today's context and disk: only fresh samples
                other.samples.clear()
                arm = not arm
        self.chosen[arm] += 1
        self._inherits = prev is arm
        self.last_arm[b] = arm
        return arm

    def observe(self, batch_size: int, budget: int, arm: bool, seconds: float) -> None:
        """A pure decode step ran with prefetch `arm` at draft `budget` in `seconds`."""
        b = bucket(batch_size)
        self.budget_of[b] = budget
        a = self._arms((b, budget))[arm]
        if self._inherits:  # else the step ran on the other arm's residency: no sample
            a.samples.add(seconds)
        a.steps += 1
        a.last_step = self.step

    def to_dict(self) -> dict:
        def arm(a: _Arm) -> dict:
            return {"best_s": a.best(), "samples": len(a.samples), "steps": a.steps}

        return {"steps_on": self.chosen[ON], "steps_off": self.chosen[OFF],
                "keys": {f"bs{b}_budget{n}": {"on": arm(v[ON]), "off": arm(v[OFF])}
                         for (b, n), v in sorted(self.arms.items())
                         if v[ON].steps or v[OFF].steps}}
