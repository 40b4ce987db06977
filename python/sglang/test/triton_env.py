"""Test-module set-up for Triton kernels: without a GPU they run in Triton's interpreter,
which must be switched on before the process first imports triton."""

from __future__ import annotations

import importlib.util
import os
import sys


def interpret_triton_without_a_gpu() -> None:
    """Skip the calling test module when triton is missing (or was imported too early to
    interpret); on a machine without CUDA set TRITON_INTERPRET=1. Call at module level,
    before anything imports triton."""
    import pytest
    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if torch.cuda.is_available():
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
