"""sglang: an SGLang fork for MoE-aware speculative decoding on long contexts.

Importing this package must not import torch: the frontend DSL and clients run without it.
Heavy parts (Engine) and the HTTP client (RuntimeEndpoint, Runtime) load on first use.
"""

from __future__ import annotations

from typing import Any

from sglang.lang.api import (assistant, assistant_begin, assistant_end, flush_cache, function,
                             gen, gen_int, gen_string, get_server_info, image, select,
                             set_default_backend, system, system_begin, system_end, user,
                             user_begin, user_end, video)
from sglang.lang.choices import (greedy_token_selection, token_length_normalized,
                                 unconditional_likelihood_normalized)
from sglang.lang.global_config import global_config

__version__ = "0.5.10.post1+moespec"

_LAZY = {
    "Engine": ("sglang.srt.entrypoints.engine", "Engine"),
    "ServerArgs": ("sglang.srt.server_args", "ServerArgs"),
    "RuntimeEndpoint": ("sglang.lang.backend.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("sglang.lang.backend.runtime", "Runtime"),
    "EngineBackend": ("sglang.lang.backend.engine_backend", "EngineBackend"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")


__all__ = [
    "Engine", "ServerArgs", "RuntimeEndpoint", "Runtime", "EngineBackend", "__version__",
    "function", "gen", "gen_int", "gen_string", "select", "image", "video", "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "flush_cache", "get_server_info", "global_config",
    "greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized",
]
