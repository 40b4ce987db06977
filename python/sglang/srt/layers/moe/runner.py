"""Which kernels run the routed experts (`--moe-runner-backend`, upstream's flag).

- `triton`: sgl_kernel's fused-MoE Triton kernel (two grouped GEMMs over expert-sorted
  pairs), the default on CUDA;
- `torch`: one GEMM pair per active expert through `layers.linear` (the CPU linear kernels
  on CPU), the CPU path; `auto` picks between them by device.
"""

from __future__ import annotations

import importlib.util

def resolve_moe_runner(backend: str, device: str) -> str:
    """'triton' or 'torch' for `--moe-runner-backend backend` on `device` (the choices are
    checked with the other flags, utils/flag_checks.py)."""
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("--moe-runner-backend triton needs the `triton` package "
                             "(pip install triton), or leave it at auto")
        return "triton"
    if str(device).startswith("cuda") and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def set_moe_runner(model, runner: str) -> None:
    """Every MoE layer of `model` runs its experts with `runner` (dense models: nothing)."""
    blocks = getattr(model, "moe_blocks", None)
    for block in (blocks() if blocks is not None else {}).values():
        block.experts.runner = runner
