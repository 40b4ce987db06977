"""ExpertStore: which experts are resident in the fast tier, and moving them there.

Each MoE layer has `num_slots` slots in the fast tier (the layer's `w13`/`w2` slot tensors);
every expert always lives in the slow tier (`sources.py`). A slot is FREE, LOADING
(a copy from the slow tier is running) or RESIDENT. Loads run on a background thread
(`prefetch`) or, for a miss, in the caller (`acquire`, which then stalls).

Invariants:
- an expert is in at most one slot of its layer;
- a pinned slot (an expert a running layer uses, between `acquire` and `release`) and a
  LOADING slot are never evicted; eviction takes a FREE slot, else the least recently used
  unpinned RESIDENT one;
- when no layer runs and no load is in flight, every slot is unpinned and FREE + RESIDENT
  slots = num_slots (`check_idle`).

API for prefetchers: `prefetch(layer, expert_ids)`, `resident(layer)`, `stats()`.
Under expert parallelism each rank's store holds only the experts it `owns`: asking it to
prefetch another rank's expert loads nothing, asking it to run one is an error.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from sglang.srt.expert_offload.slots import (FREE, LOADING, RESIDENT, Layer, victim,
                                             victim_scored)
from sglang.srt.expert_offload.sources import ExpertSource, close_source
from sglang.srt.expert_offload.store_stats import LayerStats, StoreStats  # noqa: F401

_DEMAND, _PREFETCH, _STOP = (0,), 1, (9,)  # queue priorities (prefetch: (1, layer))


@dataclasses.dataclass
class ExpertLease:
    """Experts of one layer pinned in their slots until `ExpertStore.release`."""

    layer: int
    slot_of: Dict[int, int]  # expert id -> slot index


class ExpertStore:
    def __init__(self, source: ExpertSource, layers: Dict[int, tuple], num_experts: Dict[int, int],
                 device: str = "cpu", loader_threads: int = 2,
                 owned: Optional[range] = None) -> None:
        """`layers`: layer id -> (w13 slots [S, 2I, H], w2 slots [S, H, I]), same S everywhere;
        `owned`: the expert ids this store holds (None: all of them)."""
        self.source = source
        self.owned = owned
        self._layers = {i: Layer(w13, w2, num_experts[i]) for i, (w13, w2) in layers.items()}
        sizes = {len(lay.slots) for lay in self._layers.values()}
        assert len(sizes) == 1, "every layer has the same number of slots"
        self.num_slots = sizes.pop()
        self._cond = threading.Condition()
        self._clock = 0
        self._cuda = str(device).startswith("cuda")
        # One load stream per thread that loads (the loaders and a layer's own thread): a
        # load waiting for the kernels that last read its slot (`slots.Slot.freed`) then holds up
        # only that thread's later loads, not every load of the store
        self._streams = threading.local()
        self._device = next(iter(layers.values()))[0].device if layers else None
        # (priority, seq, job): demand misses before prefetches, earlier layers first
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._seq = itertools.count()
        self._error: Optional[BaseException] = None  # a failed background load
        # Several loaders: a disk serves parallel reads faster than one at a time, and a
        # demand miss need not queue behind a prefetch (docs/decisions.md). They block in
        # read syscalls, not on the cores.
        self._workers = [threading.Thread(target=self._run, name=f"expert-store-loader-{i}",
                                          daemon=True) for i in range(max(1, loader_threads))]
        for w in self._workers:
            w.start()

    # ---- queries ---------------------------------------------------------------------------

    def layers(self) -> List[int]:
        return sorted(self._layers)

    def resident(self, layer: int) -> List[int]:
        """Experts of `layer` resident now (loads finished), sorted."""
        with self._cond:
            return sorted(s.expert for s in self._layers[layer].slots if s.state == RESIDENT)

    def mapped(self, layer: int) -> List[int]:
        """Experts of `layer` resident or on their way (a load queued or running), sorted:
        a pass that needs them loads nothing more."""
        with self._cond:
            return sorted(self._layers[layer].where)

    def num_experts(self, layer: int) -> int:
        return self._layers[layer].num_experts

    def owns(self, expert: int) -> bool:
        return self.owned is None or expert in self.owned

    def stats(self) -> StoreStats:
        with self._cond:
            return StoreStats(self.num_slots, {i: dataclasses.replace(lay.stats)
                                               for i, lay in self._layers.items()})

    def reset_stats(self) -> None:
        with self._cond:
            for lay in self._layers.values():
                lay.stats = LayerStats()

    def slot_states(self, layer: int) -> Dict[str, int]:
        """Counts of free / loading / resident / pinned slots of `layer`."""
        with self._cond:
            slots = self._layers[layer].slots
            out = {st: sum(s.state == st for s in slots) for st in (FREE, LOADING, RESIDENT)}
            out["pinned"] = sum(s.pins > 0 for s in slots)
            return out

    def check_idle(self) -> None:
        """Assert the idle invariant (no pins, no loads in flight, maps consistent)."""
        self.wait_loads()
        with self._cond:
            for i, lay in self._layers.items():
                assert all(s.pins == 0 for s in lay.slots), f"layer {i}: a slot is still pinned"
                assert all(s.state != LOADING for s in lay.slots), f"layer {i}: a load in flight"
                assert lay.where == {s.expert: j for j, s in enumerate(lay.slots)
                                     if s.state == RESIDENT}, f"layer {i}: slot map out of sync"

    # ---- prefetch --------------------------------------------------------------------------

    def prefetch(self, layer: int, expert_ids: Iterable[int]) -> int:
        """Start asynchronous loads of the experts of `layer` that are not resident, into
        free or least recently used unpinned slots; never waits and never evicts a pinned or
        loading slot (a request that finds no such slot is dropped). Returns loads queued."""
        return len(self.prefetch_experts(layer, expert_ids))

    def prefetch_experts(self, layer: int, expert_ids: Iterable[int],
                         protect: Iterable[int] = (),
                         scores: Optional[Dict[int, float]] = None) -> List[int]:
        """`prefetch`, returning the experts whose loads were queued. Neither the requested
        experts nor those in `protect` (others the caller expects the layer to need) are
        evicted to make room: a prefetch that would cost a needed expert a reload is dropped.
        With `scores` (expert -> how likely the coming pass uses it), a protected expert
        that has a score yields its slot to a requested expert with a score SWAP_MARGIN
        times higher: of two likely experts, the clearly likelier holds the slot."""
        queued: List[int] = []
        wanted = list(dict.fromkeys(int(x) for x in expert_ids))
        scores = scores or {}
        with self._cond:
            lay = self._layers[layer]
            for e in wanted:  # a bad id is an error on every rank, owned or not
                if not 0 <= e < lay.num_experts:
                    raise ValueError(f"expert id {e} out of range 0..{lay.num_experts - 1}")
            wanted = [e for e in wanted if self.owns(e)]
            asked = set(wanted)
            keep = asked | {int(x) for x in protect}
            for i, e in enumerate(wanted):
                self._check_id(lay, e)
                if e in lay.where:
                    lay.slots[lay.where[e]].last_use = self._tick()
                    continue
                j = victim_scored(lay, asked, keep, scores, scores.get(e, 0.0))
                if j is None:
                    lay.stats.dropped += sum(x not in lay.where for x in wanted[i:])
                    break
                self._claim(lay, j, e)
                self._put((_PREFETCH, layer), (layer, j, e, True))
                queued.append(e)
        return queued

    def wait_loads(self) -> None:
        """Block until every queued prefetch has finished."""
        self._queue.join()

    # ---- use by a running layer ------------------------------------------------------------

    def acquire(self, layer: int, expert_ids: Sequence[int]) -> ExpertLease:
        """Make the experts resident and pin them; at most `num_slots` distinct ids."""
        ids = list(dict.fromkeys(int(x) for x in expert_ids))
        assert len(ids) <= self.num_slots, f"{len(ids)} experts do not fit in {self.num_slots} slots"
        t0 = time.perf_counter()
        waited = False
        slot_of: Dict[int, int] = {}
        demand: List[tuple] = []  # (layer, slot, expert) this thread loads now
        missed = set()
        with self._cond:
            lay = self._layers[layer]
            for e in ids:  # pin what is there first, so the misses below cannot evict it
                self._check_id(lay, e)
                if e in lay.where:
                    self._pin_mapped(lay, layer, e, slot_of, demand)
            for e in ids:
                if e in slot_of:
                    continue
                j = victim(lay)
                while j is None and e not in lay.where:
                    # every slot pinned or loading: a load finishing frees one
                    if self._error is not None:
                        raise RuntimeError("a background expert load failed") from self._error
                    waited = True
                    self._cond.wait()
                    j = victim(lay)
                if e in lay.where:
                    # a prefetch mapped it while we waited: share that slot, never map an
                    # expert to two slots
                    self._pin_mapped(lay, layer, e, slot_of, demand)
                    continue
                lay.stats.misses += 1
                missed.add(e)
                self._claim(lay, j, e)
                lay.slots[j].pins += 1
                slot_of[e] = j
                demand.append((layer, j, e))
                # the loader threads may take some of the misses: parallel reads
                self._put(_DEMAND, (layer, j, e, False))
        for layer_, j, e in demand:  # the caller loads whatever no thread has started
            waited = True
            if self._start(layer_, j, e):
                self._load(layer_, j, e, prefetch=e not in missed)
        with self._cond:
            while any(lay.slots[j].state == LOADING for j in slot_of.values()):
                waited = True
                self._cond.wait()
            if any(lay.slots[j].expert != e for e, j in slot_of.items()):
                raise RuntimeError(f"loading an expert of layer {layer} failed") from self._error
            now = self._tick()
            for j in slot_of.values():
                lay.slots[j].last_use = now
            if waited:
                lay.stats.stall_seconds += time.perf_counter() - t0
        if self._cuda:
            for j in slot_of.values():
                event = lay.slots[j].event
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
        return ExpertLease(layer, slot_of)

    def release(self, lease: ExpertLease) -> None:
        freed = None
        if self._cuda:  # the layer's kernels are queued, not run: mark where they end
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream())
        with self._cond:
            lay = self._layers[lease.layer]
            for j in lease.slot_of.values():
                assert lay.slots[j].pins > 0, "release of an unpinned slot"
                lay.slots[j].pins -= 1
                if freed is not None:
                    lay.slots[j].freed = freed
            self._cond.notify_all()

    def weights(self, layer: int):
        """(w13 slots, w2 slots) of `layer`: index them with a lease's slot ids."""
        lay = self._layers[layer]
        return lay.w13, lay.w2

    def close(self) -> None:
        for _ in self._workers:
            self._put(_STOP, None)
        for w in self._workers:
            w.join(timeout=10)
        close_source(self.source)

    # ---- internals (called with the lock held, except _load/_run) --------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_id(self, lay: Layer, e: int) -> None:
        if not 0 <= e < lay.num_experts:
            raise ValueError(f"expert id {e} out of range 0..{lay.num_experts - 1}")
        if not self.owns(e):
            raise ValueError(f"expert {e} belongs to another expert-parallel rank "
                             f"(this one holds {self.owned.start}..{self.owned.stop - 1})")

    @staticmethod
    def _pin_mapped(lay: Layer, layer: int, e: int, slot_of: Dict[int, int],
                    demand: List[tuple]) -> None:
        """Pin the slot `e` is mapped to; take over its load if no thread started it."""
        j = lay.where[e]
        slot = lay.slots[j]
        slot.pins += 1
        if slot.state == RESIDENT:
            lay.stats.hits += 1
        else:
            lay.stats.late += 1
            if not slot.started:  # still queued behind other prefetches: do it now
                demand.append((layer, j, e))
        slot_of[e] = j

    def _claim(self, lay: Layer, j: int, e: int) -> None:
        slot = lay.slots[j]
        if slot.state == RESIDENT:
            del lay.where[slot.expert]
            lay.stats.evictions += 1
        slot.expert, slot.state, slot.event, slot.started = e, LOADING, None, False
        lay.where[e] = j

    def _load(self, layer: int, j: int, e: int, prefetch: bool) -> None:
        lay = self._layers[layer]
        event = None
        t0 = time.perf_counter()
        if self._cuda:
            stream = getattr(self._streams, "stream", None)
            if stream is None:
                stream = self._streams.stream = torch.cuda.Stream(device=self._device)
            with torch.cuda.stream(stream):
                freed = lay.slots[j].freed
                if freed is not None:  # the slot's previous expert may still be computing
                    stream.wait_event(freed)
                nbytes = self.source.read_into(layer, e, lay.w13[j], lay.w2[j])
                event = torch.cuda.Event()
                event.record(stream)
        else:
            nbytes = self.source.read_into(layer, e, lay.w13[j], lay.w2[j])
        with self._cond:
            slot = lay.slots[j]
            slot.state, slot.event = RESIDENT, event
            slot.last_use = max(slot.last_use, self._tick())
            lay.stats.loads += 1
            lay.stats.prefetch_loads += int(prefetch)
            lay.stats.bytes_loaded += nbytes
            lay.stats.load_seconds += time.perf_counter() - t0
            self._cond.notify_all()

    def _put(self, priority: tuple, job: Optional[tuple]) -> None:
        self._queue.put((priority, next(self._seq), job))

    def _start(self, layer: int, j: int, e: int) -> bool:
        """Claim the load of expert e into slot j if no thread has begun it."""
        with self._cond:
            slot = self._layers[layer].slots[j]
            mine = slot.state == LOADING and slot.expert == e and not slot.started
            slot.started = slot.started or mine
            return mine

    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            try:
                if job is None:
                    return
                layer, j, e, prefetch = job
                if self._start(layer, j, e):  # else another thread took it (or the slot moved on)
                    self._load(layer, j, e, prefetch=prefetch)
            except BaseException as exc:  # a failed load must not leave waiters hanging
                with self._cond:
                    layer, j, e, _ = job
                    lay = self._layers[layer]
                    lay.where.pop(e, None)
                    # the slot's release event stays: its last kernels may still be queued
                    lay.slots[j] = _Slot(freed=lay.slots[j].freed)
                    self._error = exc
                    self._cond.notify_all()
            finally:
                self._queue.task_done()
