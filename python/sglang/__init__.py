"""sglang: an SGLang fork for MoE-aware speculative decoding on long contexts.

Importing this package must not import torch: the frontend DSL and clients run without it.
Heavy parts (Engine) load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.5.10.post1+moespec"

_LAZY = {
    "Engine": ("sglang.srt.entrypoints.engine", "Engine"),
    "ServerArgs": ("sglang.srt.server_args", "ServerArgs"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")


__all__ = ["Engine", "ServerArgs", "__version__"]
