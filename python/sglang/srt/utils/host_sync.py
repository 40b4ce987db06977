"""The step's device-to-host reads, each through here under a name, so they stay few, named
and counted (issue 29). On CUDA each one waits for the GPU to drain its queue; on CPU it is
free, but the same call sites run, so the CPU suite counts what a GPU step would sync.

Only reads of tensors that live on the model's device belong here; host-side bookkeeping
tensors (n-gram histories, routing statistics built on the CPU) are not syncs. The scheduler
resets the count at each step and keeps it (`SyncStats`; /server_info shows it).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict

import torch

_counts: "collections.Counter[str]" = collections.Counter()


def to_list(t: torch.Tensor, site: str) -> list:
    _counts[site] += 1
    return t.tolist()


def to_int(t: torch.Tensor, site: str) -> int:
    _counts[site] += 1
    return int(t)


def to_bool(t: torch.Tensor, site: str) -> bool:
    _counts[site] += 1
    return bool(t)


def to_float(t: torch.Tensor, site: str) -> float:
    _counts[site] += 1
    return float(t)


def to_cpu(t: torch.Tensor, site: str) -> torch.Tensor:
    """One copy of a whole tensor, when the host walks many of its entries."""
    _counts[site] += 1
    return t.cpu()


def take() -> Dict[str, int]:
    """The reads since the last take, by site; starts a new count."""
    out = dict(_counts)
    _counts.clear()
    return out


@dataclasses.dataclass
class SyncStats:
    """Per step: the last step's reads by site, and over decode-only steps their mean."""

    last_step: Dict[str, int] = dataclasses.field(default_factory=dict)
    decode_steps: int = 0
    decode_totals: "collections.Counter[str]" = dataclasses.field(
        default_factory=collections.Counter)

    def record(self, counts: Dict[str, int], decode_only: bool) -> None:
        self.last_step = counts
        if decode_only:
            self.decode_steps += 1
            self.decode_totals.update(counts)

    def per_decode_step(self) -> Dict[str, float]:
        n = max(self.decode_steps, 1)
        return {site: round(c / n, 3) for site, c in sorted(self.decode_totals.items())}

    def to_dict(self) -> Dict[str, object]:
        per = self.per_decode_step()
        return {"last_step": dict(self.last_step), "decode_steps": self.decode_steps,
                "per_decode_step": per, "per_decode_step_total": round(sum(per.values()), 3)}
