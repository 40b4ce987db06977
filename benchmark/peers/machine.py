"""The machine's state beside a peer run: what the CPU is, the bandwidth measured at the start,
and the load and steal while the engines decoded (a shared VM's neighbours move tokens/s by
up to 2x; a run whose steal was high is a run to redo, not a result)."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


def cpu_facts(cpuinfo: str = "/proc/cpuinfo") -> Dict[str, object]:
    model, flags = "unknown", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(),
            "flags": {f: f in flags for f in FLAGS}}


def cpu_times(stat: str = "/proc/stat") -> Optional[List[int]]:
    """The aggregate `cpu` line: user nice system idle iowait irq softirq steal ..."""
    try:
        with open(stat) as f:
            first = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in first[1:9]] if first and first[0] == "cpu" else None


def busy_and_steal(before: Optional[List[int]], after: Optional[List[int]]) -> Dict[str, object]:
    """Shares of the CPU time between two samples: busy (not idle / iowait) and stolen by the
    hypervisor for other guests."""
    if not before or not after:
        return {"busy": None, "steal": None}
    d = [b - a for a, b in zip(before, after)]
    total = sum(d)
    if total <= 0:
        return {"busy": None, "steal": None}
    idle = d[3] + d[4]
    return {"busy": round((total - idle) / total, 3), "steal": round(d[7] / total, 4)}


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class RunState:
    """Samples taken at the start and after every round: load average, busy and steal
    shares of each round (parent and workers together)."""

    def __init__(self) -> None:
        self.rounds: List[Dict[str, object]] = []
        self._last = cpu_times()
        self._t = time.time()

    def round_done(self, r: int) -> None:
        now = cpu_times()
        self.rounds.append({"round": r, "seconds": round(time.time() - self._t, 1),
                            "load_1min": load_average(), **busy_and_steal(self._last, now)})
        self._last, self._t = now, time.time()

    def report(self) -> Dict[str, object]:
        steals = [s["steal"] for s in self.rounds if s["steal"] is not None]
        return {"rounds": self.rounds, "max_steal": max(steals) if steals else None}
