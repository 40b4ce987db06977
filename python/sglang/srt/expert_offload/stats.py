"""Prefetch figures per layer: recall, precision, over-fetch, bytes fetched vs used."""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional


@dataclasses.dataclass
class LayerFigures:
    uses: int = 0  # forwards that ran this layer
    needed: int = 0  # distinct experts those forwards routed to (summed over uses)
    in_time: int = 0  # of those, resident when the layer ran
    fetched: int = 0  # experts the prefetcher had loaded for this layer since its last use
    fetched_used: int = 0  # of those, routed to by the use that followed
    predicted: int = 0  # experts the predictors named for the use (resident already or not)
    predicted_used: int = 0  # of those, routed to by the use
    reachable: int = 0  # min(needed, slots): what a perfect prefetch could have made resident

    def add(self, other: "LayerFigures") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self, expert_bytes: int) -> dict:
        return {**dataclasses.asdict(self),
                "recall": self.in_time / self.needed if self.needed else 1.0,
                "precision": self.fetched_used / self.fetched if self.fetched else None,
                "overfetch": self.fetched / self.fetched_used if self.fetched_used else None,
                "bytes_fetched": self.fetched * expert_bytes,
                "bytes_fetched_used": self.fetched_used * expert_bytes,
                "predicted_recall": self.predicted_used / self.needed if self.needed else 1.0,
                "predicted_overfetch": (self.predicted / self.predicted_used
                                        if self.predicted_used else None),
                "recall_ceiling": self.reachable / self.needed if self.needed else 1.0}


class PrefetchStats:
    """Recall / precision bookkeeping; pure, so it is tested on scripted routing traces."""

    def __init__(self, expert_bytes: int = 0, num_slots: Optional[int] = None) -> None:
        self.expert_bytes = expert_bytes
        self.num_slots = num_slots  # of each layer's fast tier (None: unbounded)
        self.layers: Dict[int, LayerFigures] = {}
        self._pending: Dict[int, set] = {}  # layer -> prefetched since its last use
        self._named: Dict[int, set] = {}  # layer -> predicted since its last use

    def fetched(self, layer: int, experts: Iterable[int]) -> None:
        self._pending.setdefault(layer, set()).update(int(e) for e in experts)

    def predicted(self, layer: int, experts: Iterable[int]) -> None:
        self._named.setdefault(layer, set()).update(int(e) for e in experts)

    def used(self, layer: int, needed: Iterable[int], resident: Iterable[int]) -> None:
        needed = {int(e) for e in needed}
        fetched = self._pending.pop(layer, set())
        named = self._named.pop(layer, set())
        fig = self.layers.setdefault(layer, LayerFigures())
        fig.uses += 1
        fig.needed += len(needed)
        fig.in_time += len(needed & {int(e) for e in resident})
        fig.fetched += len(fetched)
        fig.fetched_used += len(fetched & needed)
        fig.predicted += len(named)
        fig.predicted_used += len(named & needed)
        fig.reachable += len(needed) if self.num_slots is None else min(len(needed),
                                                                         self.num_slots)

    def skip(self, layer: int) -> None:
        """The layer ran without prefetch (the gate had it off): nothing to score."""
        self._pending.pop(layer, None)
        self._named.pop(layer, None)

    def total(self) -> LayerFigures:
        out = LayerFigures()
        for fig in self.layers.values():
            out.add(fig)
        return out

    def to_dict(self) -> dict:
        return {"total": self.total().as_dict(self.expert_bytes),
                "layers": {str(k): v.as_dict(self.expert_bytes)
                           for k, v in sorted(self.layers.items())}}

    def reset(self) -> None:
        self.layers.clear()
        self._pending.clear()
        self._named.clear()
