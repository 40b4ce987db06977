"""Online statistics shared by the speculation cost model (speculative/cost_model.py), the
expert prefetch gate (expert_offload/gate.py) and the tree budget (expert_offload/tree_budget.py).

- `batch_bucket` / `bucket_sizes`: the batch sizes step times are kept apart by;
- `WindowedMin`: the fastest of the last N samples, for step timers (noise on a shared
  host only ever adds time, so the recent minimum is the honest cost);
- `ema`: a decayed moving average, for prices that drift (load seconds, step seconds,
  acceptance's decayed sums).

Bottom layer: standard library only (no torch, nothing from sglang).
"""

from __future__ import annotations

import collections
from typing import Deque, Iterable, Iterator, List, Optional

__all__ = ["batch_bucket", "bucket_sizes", "WindowedMin", "ema"]


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3, 4, 8, 16, 32, ...: sizes up to 4 stand for themselves, larger ones round up
    to the next power of two (a step's cost moves most at small batches)."""
    return batch_size if batch_size <= 4 else 1 << (batch_size - 1).bit_length()


def bucket_sizes(limit: int) -> List[int]:
    """Every bucket `batch_bucket` returns that is at most `limit`, ascending."""
    sizes = [s for s in (1, 2, 3, 4) if s <= limit]
    s = 8
    while s <= limit:
        sizes.append(s)
        s *= 2
    return sizes


class WindowedMin:
    """The smallest of the last `window` samples (older ones are forgotten). Iterates, and
    `len`s, over the samples kept, oldest first."""

    def __init__(self, window: int, samples: Iterable[float] = ()) -> None:
        self._recent: Deque[float] = collections.deque(samples, maxlen=window)

    @property
    def window(self) -> int:
        return self._recent.maxlen  # type: ignore[return-value]

    def add(self, sample: float) -> None:
        self._recent.append(sample)

    append = add  # deque-like, for callers that keep a plain list of samples in step

    def extend(self, samples: Iterable[float]) -> None:
        self._recent.extend(samples)

    def clear(self) -> None:
        self._recent.clear()

    @property
    def value(self) -> Optional[float]:
        """The minimum of the kept samples; None when there are none."""
        return min(self._recent) if self._recent else None

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self) -> Iterator[float]:
        return iter(self._recent)

    def __repr__(self) -> str:
        return f"WindowedMin(window={self.window}, samples={list(self._recent)})"


def ema(old: Optional[float], new: float, decay: float) -> float:
    """One step of a decayed moving average: `decay` x old + (1 - decay) x new; the first
    sample (`old` None) is taken as it is."""
    return new if old is None else decay * old + (1 - decay) * new
