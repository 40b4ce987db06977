"""The step's device-to-host reads, each through here under a name, so they stay few, named
and counted (issue 29). On CUDA each one waits for the GPU to drain its queue; on CPU it is
free, but the same call sites run, so the CPU suite counts what a GPU step would sync.

Only reads of tensors that live on the model's device belong here; host-side bookkeeping
tensors (n-gram histories, routing statistics built on the CPU) are not syncs. The scheduler
resets the count at each step and keeps it (`SyncStats`; /server_info shows it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
from typing import Dict, Iterator

import torch
from torch.overrides import TorchFunctionMode

_counts: "collections.Counter[str]" = collections.Counter()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor (the tests' stand-in for a GPU) has no values: a named read of one gets
    ones of its shape, so the code after it takes its data-dependent paths (every id present,
    every group one entry); an unnamed read of it still raises."""
    return torch.ones(t.shape, dtype=t.dtype) if t.is_meta else t


def to_list(t: torch.Tensor, site: str) -> list:
    _counts[site] += 1
    return _values(t).tolist()


def to_int(t: torch.Tensor, site: str) -> int:
    _counts[site] += 1
    return int(_values(t))


def to_bool(t: torch.Tensor, site: str) -> bool:
    _counts[site] += 1
    return bool(_values(t))


def to_float(t: torch.Tensor, site: str) -> float:
    _counts[site] += 1
    return float(_values(t))


def to_cpu(t: torch.Tensor, site: str) -> torch.Tensor:
    """One copy of a whole tensor, when the host walks many of its entries."""
    _counts[site] += 1
    return _values(t).cpu()


def id_counts(ids: torch.Tensor, num_ids: int, site: str) -> list:
    """How many entries of `ids` (values -1 .. num_ids - 1) hold each value, -1 first, in one
    named read: a fixed-size sum on the device (`unique`'s data-dependent size would cost a
    GPU a second, hidden sync)."""
    flat = ids.reshape(-1) + 1
    counts = torch.zeros(num_ids + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return to_list(counts, site)


def present_ids(ids: torch.Tensor, num_ids: int, site: str) -> list:
    """The values >= 0 in `ids`, ascending (what `torch.unique` gives, without its sync)."""
    return [e for e, n in enumerate(id_counts(ids, num_ids, site)[1:]) if n]


# torch functions that read a tensor's values on the host (a GPU waits for its queue), or
# whose output shape depends on values (a GPU waits to learn it)
READ_FUNCS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__",
                        "cpu", "numpy", "nonzero", "unique", "unique_consecutive",
                        "masked_select"})


def is_read(func, args) -> bool:
    """Whether a torch call reads device values on the host (boolean-mask indexing too)."""
    name = getattr(func, "__name__", "")
    if name in READ_FUNCS:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1]
        return isinstance(index, torch.Tensor) and index.dtype == torch.bool
    return False


class _ForbidReads(TorchFunctionMode):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if is_read(func, args) and not _inside_triton():
            raise RuntimeError(f"{getattr(func, '__name__', func)} reads a device value on the "
                               f"host inside {self.what}, which cannot hold one")
        return func(*args, **(kwargs or {}))


def _inside_triton() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) reads its arguments on the
    host by design; a compiled kernel does not."""
    frame, mark = sys._getframe(2), os.sep + "triton" + os.sep
    while frame is not None:
        if mark in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def forbid_reads(what: str) -> Iterator[None]:
    """Raise on any host read of a tensor's values inside the block (a CUDA graph's
    capture fails on one; `model_executor/cuda_graph_runner.EagerGraph` checks it on CPU)."""
    with _ForbidReads(what):
        yield


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
