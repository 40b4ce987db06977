"""Process-wide settings of the frontend (upstream: `sglang.global_config.global_config`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GlobalConfig:
    # Backend used when `run` / `run_batch` get no `backend=`; see `set_default_backend`.
    default_backend: Any = None
    verbosity: int = 0
    # Sent in every gen request's sampling_params (upstream sends both, always).
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    # run_batch with more than one program: trace the constant prefix and cache it first.
    enable_precache_with_tracing: bool = True
    # A traced prefix shorter than this is not worth a request.
    precache_min_chars: int = 64


global_config = GlobalConfig()
