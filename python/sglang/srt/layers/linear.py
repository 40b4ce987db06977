"""Linear layers: x @ W^T + b, on CPU through sgl_kernel's small-M kernel where it wins.

Torch's CPU bf16 GEMM is fast only for one row (gemv); at 2-64 rows it is 4-80x slower than
at one, which would make verifying speculative tokens cost more than it saves. The kernel
(sgl_kernel.cpu.small_m_linear) reads W from DRAM once per call whatever the row count.

Routing rule (benchmark/kernels/bench_cpu_linear.py, Zen 3 AVX2, compared per call):
- bf16 W, rows <= 128: the kernel (torch bf16 is 2-8x slower from 2 rows on; ~equal at 1).
- bf16 W, rows > 128: W upcast to fp32 once per call + MKL sgemm; compute-bound there, and
  MKL's fp32 GEMM beats the kernel by ~20% (torch's bf16 GEMM is 4-8x slower than both).
- fp32 W, rows <= 32: the kernel (1.1-2x faster than MKL); above, MKL (F.linear).
- anything else (GPU tensors, fp16, autograd, kernel not built): F.linear.
Invariant: the result equals F.linear's up to fp32 summation order (bf16 outputs round once).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_MAX_ROWS_BF16 = 128
KERNEL_MAX_ROWS_FP32 = 32

_FLOATS = (torch.float32, torch.bfloat16)
_kernel: Optional[Callable[..., torch.Tensor]] = None  # small_m_linear once known to work
_checked = False


def _import_cpu_kernels() -> Optional[ModuleType]:
    try:
        import sgl_kernel.cpu as cpu

        return cpu
    except ImportError:
        pass
    # A source checkout keeps the package in <repo>/sgl-kernel beside <repo>/python.
    here = os.path.abspath(__file__)
    for _ in range(5):
        here = os.path.dirname(here)
    kernel_dir = os.path.join(here, "sgl-kernel")
    if not os.path.isdir(os.path.join(kernel_dir, "sgl_kernel")) or kernel_dir in sys.path:
        return None
    sys.path.append(kernel_dir)
    try:
        import sgl_kernel.cpu as cpu

        return cpu
    except ImportError:
        return None


def cpu_kernel_available() -> bool:
    """True when sgl_kernel's CPU linear is importable and built. The first call builds it
    (1-2 minutes, once per machine: the build is cached); call it at model load so no
    forward pass waits on the compiler."""
    global _kernel, _checked
    if not _checked:
        cpu = _import_cpu_kernels()
        _kernel = cpu.small_m_linear if cpu is not None and cpu.is_available() else None
        _checked = True
    return _kernel is not None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in _FLOATS
            or weight.dtype not in _FLOATS or (bias is not None and bias.dtype not in _FLOATS)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return F.linear(x, weight, bias)
    rows = _rows(x)
    if weight.dtype == torch.bfloat16:
        if rows > KERNEL_MAX_ROWS_BF16:
            b = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
    elif rows > KERNEL_MAX_ROWS_FP32:
        return F.linear(x, weight, bias)
    if not cpu_kernel_available():
        return F.linear(x, weight, bias)
    return _kernel(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and init) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
