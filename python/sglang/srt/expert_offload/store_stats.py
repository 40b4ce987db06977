"""The expert store's figures: per layer, hits / misses / late prefetches, loads and their
bytes and seconds, evictions and dropped prefetches (`ExpertStore.stats()`)."""

from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass
class LayerStats:
    hits: int = 0  # acquire found the expert resident
    misses: int = 0  # acquire had to load it (in the caller)
    late: int = 0  # acquire found it still loading (a prefetch that came too late)
    loads: int = 0  # completed loads, demand + prefetch
    prefetch_loads: int = 0
    bytes_loaded: int = 0
    evictions: int = 0
    dropped: int = 0  # prefetch requests refused: every other slot pinned, loading or protected
    stall_seconds: float = 0.0  # time acquire spent waiting for loads
    load_seconds: float = 0.0  # time the reads took (on a GPU: queueing the copies)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses + self.late
        return self.hits / n if n else 1.0


@dataclasses.dataclass
class StoreStats:
    num_slots: int
    layers: Dict[int, LayerStats]

    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers.values():
            for f in dataclasses.fields(LayerStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
        return out

    def to_dict(self) -> dict:
        total = self.total()
        return {"num_slots": self.num_slots,
                "total": {**dataclasses.asdict(total), "hit_rate": total.hit_rate},
                "layers": {str(k): {**dataclasses.asdict(v), "hit_rate": v.hit_rate}
                           for k, v in self.layers.items()}}
