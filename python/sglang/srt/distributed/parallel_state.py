"""The tensor-parallel group of this process and its collectives (torch.distributed: gloo on
CPU, NCCL on CUDA). One scheduler process per TP rank, as upstream; every rank runs the same
step on its shard of the weights, and these are the only places the ranks meet.

With tp_size 1 (the default, nothing initialised) every collective is the identity, so the
single-device path pays nothing and needs no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None when size == 1)
    # Expert parallelism within the TP group (1 or size): each rank owns E / ep_size whole
    # experts instead of a 1 / size slice of every expert.
    ep_size: int = 1
    # The process's own rank even inside `replicated()` (which device it uses)
    device_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_TP = TPGroup()


@dataclasses.dataclass
class CollectiveStats:
    """Collectives of the forward pass (all-reduce, all-gather) run and their seconds, for
    the TP overhead benchmark; two perf_counter calls per collective."""
    calls: int = 0
    seconds: float = 0.0


COLLECTIVES = CollectiveStats()


def tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: Optional[str],
                         backend: Optional[str] = None, timeout_s: float = 600,
                         ep_size: int = 1) -> TPGroup:
    """Join the TP group (blocks until all `size` ranks joined). `init_method` is a
    torch.distributed URL, e.g. tcp://127.0.0.1:29500."""
    global _TP
    if ep_size not in (1, size):
        raise ValueError(f"--ep-size {ep_size} must be 1 or --tp-size ({size})")
    if size == 1:
        _TP = TPGroup()
        return _TP
    import datetime

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _TP = TPGroup(rank, size, dist.group.WORLD, ep_size, device_rank=rank)
    return _TP


@contextlib.contextmanager
def replicated() -> Iterator[None]:
    """Build a model whole on every rank (the draft model under TP): inside, the group looks
    like one rank (layers built here keep every head and run no collective), except for the
    device the process uses."""
    global _TP
    outer = _TP
    _TP = TPGroup(device_rank=outer.device_rank)
    try:
        yield
    finally:
        _TP = outer


def rank0_value(x: float) -> float:
    """Rank 0's value of a measurement (a step's seconds) on every rank: decisions taken on
    timings (the cost model, the fallback, calibration) are then the same on all ranks,
    which must step alike."""
    if _TP.size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, src=0, group=_TP.group)
    return float(t.item())


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
    if _TP.size > 1:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=_TP.group)
        COLLECTIVES.calls += 1
        COLLECTIVES.seconds += time.perf_counter() - t0
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The ranks' shards side by side along the last dim, in rank order (column-parallel
    outputs that every rank needs whole: the logits)."""
    if _TP.size == 1:
        return x
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    COLLECTIVES.calls += 1
    COLLECTIVES.seconds += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def broadcast_objects(objs: List[Any], src: int = 0) -> List[Any]:
    """Rank `src`'s list on every rank (what the first rank received this step)."""
    if _TP.size == 1:
        return objs
    box = [objs if _TP.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=_TP.group)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest of the ranks' values (pool sizes every rank must agree on)."""
    if _TP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.group)
    return int(t.item())


def gather_objects(obj: Any) -> List[Any]:
    """Every rank's `obj`, in rank order, on every rank (checks that the ranks agree)."""
    if _TP.size == 1:
        return [obj]
    out: List[Any] = [None] * _TP.size
    dist.all_gather_object(out, obj, group=_TP.group)
    return out


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"--tp-size {size} must divide the model's {what} ({total})")
    return total // size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: split when there are at least as many as ranks, else each
    rank keeps one, replicated (GQA with fewer KV heads than ranks, as upstream)."""
    if num_kv_heads >= size:
        return divide(num_kv_heads, size, "number of KV heads")
    divide(size, num_kv_heads, "ranks per KV head (tp size / KV heads)")
    return 1


def kv_head_of_rank(rank: int, num_kv_heads: int, size: int) -> int:
    """First KV head (checkpoint index) this rank holds."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)
