"""One registry of names: speculative algorithms, expert predictors, attention backends.

Each entry maps a name to "module:attribute", imported only when the name is built, so
this module stays free of torch and of every layer above it (ServerArgs takes its CLI
choices from here). `Registry.load(name)` returns the attribute; unknown names get an
error that lists the valid ones.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple


class Registry:
    def __init__(self, flag: str, entries: Dict[str, str]) -> None:
        self.flag = flag  # the CLI flag whose choices these are
        self.entries = dict(entries)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def check(self, name: str) -> None:
        if name not in self.entries:
            raise ValueError(f"{self.flag} must be one of {self.names}, got {name!r}")

    def load(self, name: str) -> Any:
        self.check(name)
        module, attr = self.entries[name].split(":")
        return getattr(importlib.import_module(module), attr)


SPECULATIVE_ALGORITHMS = Registry("--speculative-algorithm", {
    "STANDALONE": "sglang.srt.speculative.drafters.standalone:build",
    "NGRAM": "sglang.srt.speculative.drafters.ngram:build",
    "HYBRID": "sglang.srt.speculative.drafters.hybrid:build",
    "EAGLE": "sglang.srt.speculative.drafters.eagle:build",
    "EAGLE3": "sglang.srt.speculative.drafters.eagle3:build",
    "NEXTN": "sglang.srt.speculative.drafters.nextn:build",
})

EXPERT_PREDICTORS = Registry("--moe-prefetch-predictor", {
    "none": "sglang.srt.expert_offload.predictors.base:build",
    "reuse": "sglang.srt.expert_offload.predictors.reuse:build",
    "layer_ahead": "sglang.srt.expert_offload.predictors.layer_ahead:build",
    "draft": "sglang.srt.expert_offload.predictors.draft:build",
    "ensemble": "sglang.srt.expert_offload.predictors.ensemble:build",
})

ATTENTION_BACKENDS = Registry("--attention-backend", {
    "torch_native": "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "triton": "sglang.srt.layers.attention.triton_backend:TritonAttnBackend",
})
