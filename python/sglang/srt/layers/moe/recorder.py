"""Expert distribution recorder: which experts each token chose, per layer.

One recorder per process (`get_expert_recorder()`); MoE layers call `record(layer, ids)`
with their router's top-k choice, which costs one flag check while recording is off.
A forward is one step: `begin_step(input_ids, positions)` (called by the model) opens it,
so every record can be tied back to its tokens. `dump(dir)` writes one `.pt` file:

    {"version": 1, "num_layers", "num_experts", "top_k",
     "steps": [{"model": str, "input_ids": [T], "positions": [T],
                "topk_ids": {layer: int16 [T, k]}}, ...],
     "counts": int64 [num_layers, num_experts]}   # token-choices per (layer, expert)

Invariant: the `topk_ids` recorded for a layer are exactly its router's choices, in token
order of the forward batch.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import torch


class ExpertDistributionRecorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.recording = False
        self._steps: List[Dict[str, Any]] = []
        self._num_layers = 0
        self._num_experts = 0
        self._top_k = 0
        # name -> callable whose result the dump carries (the scheduler adds the expert
        # store's and the prefetcher's figures for the target model)
        self.extras: Dict[str, Any] = {}

    # ---- control (scheduler side) ----------------------------------------------------------

    def start(self) -> None:
        """Start a fresh recording (earlier records are dropped)."""
        with self._lock:
            self._steps = []
            self.recording = True

    def stop(self) -> None:
        with self._lock:
            self.recording = False

    def reset(self) -> None:
        with self._lock:
            self._steps = []

    # ---- hooks (model side) ----------------------------------------------------------------

    def begin_step(self, input_ids: torch.Tensor, positions: torch.Tensor, model: str = "") -> None:
        """Open a step; `model` names the model that runs it (a target and an MoE draft both
        record, and their steps must not be confused)."""
        if not self.recording:
            return
        with self._lock:
            self._steps.append({"model": model, "input_ids": input_ids.detach().cpu().clone(),
                                "positions": positions.detach().cpu().clone(), "topk_ids": {}})

    def record(self, layer: int, topk_ids: torch.Tensor, num_experts: int) -> None:
        """topk_ids [T, k]: the experts layer `layer` chose for each token of this step."""
        if not self.recording:
            return
        with self._lock:
            if not self._steps:  # a caller that does not mark steps: one step per layer-0 call
                self._steps.append({"model": "", "input_ids": None, "positions": None, "topk_ids": {}})
            step = self._steps[-1]
            if layer in step["topk_ids"]:
                step = {"model": step["model"], "input_ids": None, "positions": None, "topk_ids": {}}
                self._steps.append(step)
            step["topk_ids"][layer] = topk_ids.detach().to("cpu", torch.int16).clone()
            self._num_layers = max(self._num_layers, layer + 1)
            self._num_experts = max(self._num_experts, num_experts)
            self._top_k = int(topk_ids.shape[-1])

    # ---- results ---------------------------------------------------------------------------

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            steps = [dict(s, topk_ids=dict(s["topk_ids"])) for s in self._steps]
            num_layers, num_experts, top_k = self._num_layers, self._num_experts, self._top_k
        counts = torch.zeros((num_layers, max(num_experts, 1)), dtype=torch.int64)
        for step in steps:
            for layer, ids in step["topk_ids"].items():
                counts[layer] += torch.bincount(ids.reshape(-1).long(), minlength=counts.shape[1])
        return {"version": 1, "num_layers": num_layers, "num_experts": num_experts,
                "top_k": top_k, "steps": steps, "counts": counts,
                **{name: fn() for name, fn in list(self.extras.items())}}

    def dump(self, out_dir: Optional[str] = None) -> str:
        """Write the records to `out_dir` (default: `default_dump_dir()`); returns the file's
        path. Recording state is unchanged."""
        out_dir = out_dir or default_dump_dir()
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"expert_distribution_recorder_{time.time():.6f}.pt")
        torch.save(self.snapshot(), path)
        return path


def default_dump_dir() -> str:
    """Upstream's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else a folder in the temp dir."""
    return (os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR")
            or os.path.join(tempfile.gettempdir(), "sglang_expert_distribution"))


_RECORDER = ExpertDistributionRecorder()


def get_expert_recorder() -> ExpertDistributionRecorder:
    return _RECORDER
