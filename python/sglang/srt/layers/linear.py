"""Linear layers: x @ W^T + b, on CPU through sgl_kernel's small-M kernel where it wins.

Torch's CPU bf16 GEMM is fast only for one row (gemv); at 2-64 rows it is 4-80x slower than
at one, which would make verifying speculative tokens cost more than it saves. The kernel
(sgl_kernel.cpu.small_m_linear) reads W from DRAM once per call whatever the row count.

Routing rule (benchmark/kernels/bench_cpu_linear.py on Zen 3 AVX2; the figures behind each
threshold are in docs/decisions.md):
- bf16 W, rows <= 64: the kernel (faster than torch's bf16 gemv at 1 row and its GEMM from 2).
- bf16 W, rows > 64: W upcast to fp32 per call + MKL sgemm: compute-bound there, and from
  ~128 rows MKL beats the kernel; torch's bf16 GEMM is slower than both on AVX2. With
  AVX512-BF16 (Zen 4) torch's bf16 GEMM is 2.2-2.5x the upcast there and takes these rows.
- fp32 W, rows <= 32: the kernel (at least as fast as MKL); above, MKL (F.linear).
- anything else (non-CPU tensors, fp16, autograd, kernel not built): F.linear.
On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) torch's own bf16 GEMM (oneDNN on
AMX) is another animal: it beats the kernel from ~10 rows and the fp32 upcast at prefill
sizes. There, bf16 W with more rows than the kernel takes in one sweep (10) goes to torch's
bf16 F.linear; up to 10 the kernel keeps each row's bits equal to a 1-row call (a verify row
equals the decode row).
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

KERNEL_MAX_ROWS_BF16 = 64
KERNEL_MAX_ROWS_FP32 = 32
KERNEL_MAX_ROWS_BF16_AMX = 10  # the AVX512-BF16 kernel's one sweep of W
# torch's bf16 GEMM runs on AMX here (torch's own check, the one its oneDNN GEMM goes by):
# large bf16 products stay in bf16 (see the docstring)
BF16_GEMM_NATIVE = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
# AVX512-BF16 without AMX (Zen 4): torch's bf16 GEMM (oneDNN) is 2.2-2.5x the fp32 upcast
# and beats the kernel from 64 rows (cpu_linear_zen4_large.json): products above the
# kernel's 64 rows stay in bf16 there too; verify and decode rows keep the kernel
BF16_GEMM_LARGE = BF16_GEMM_NATIVE or bool(
    getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())

# weight dtype -> most rows sent to the kernel; also the dtypes the kernel takes.
_KERNEL_ROWS = {torch.bfloat16: KERNEL_MAX_ROWS_BF16, torch.float32: KERNEL_MAX_ROWS_FP32}
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


_ops: Optional[ModuleType] = None  # sgl_kernel.cpu once known to be built


def cpu_ops(*tensors: torch.Tensor) -> Optional[ModuleType]:
    """sgl_kernel.cpu when its kernels are built and can take these tensors (CPU, float32 or
    bfloat16, one dtype, no autograd, 2-D with contiguous rows), else None: the caller then
    runs its torch code. For the per-token ops of a layer (norm, rotary, activation)."""
    t0 = tensors[0]
    if (t0.dtype not in _KERNEL_ROWS or not t0.is_cpu
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    for t in tensors:
        if t.dtype != t0.dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    if _ops is None and not cpu_kernel_available():
        return None
    return _ops


def cpu_kernel_available() -> bool:
    """True when sgl_kernel's CPU linear is importable and built. The first call builds it
    (1-2 minutes, once per machine: the build is cached); call it at model load so no
    forward pass waits on the compiler."""
    global _kernel, _ops, _checked
    if not _checked:
        cpu = _import_cpu_kernels()
        _ops = cpu if cpu is not None and cpu.is_available() else None
        _kernel = _ops.small_m_linear if _ops is not None else None
        _checked = True
    return _kernel is not None


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K], bias [N] -> [..., N]."""
    # Checks ordered cheapest-first: this runs once per projection per forward pass.
    limit = _KERNEL_ROWS.get(weight.dtype)
    if (limit is None or x.dtype not in _KERNEL_ROWS or not x.is_cpu or not weight.is_cpu
            or (bias is not None and bias.dtype not in _KERNEL_ROWS)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return F.linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)
    if (BF16_GEMM_NATIVE and rows > KERNEL_MAX_ROWS_BF16_AMX and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)):
        return F.linear(x, weight, bias)  # oneDNN on AMX
    if rows > limit:
        if (BF16_GEMM_LARGE and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
                and (bias is None or bias.dtype == torch.bfloat16)):
            return F.linear(x, weight, bias)  # oneDNN's AVX512-BF16 GEMM
        if weight.dtype == torch.bfloat16:
            b = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
        return F.linear(x, weight, bias)
    if _kernel is None and not cpu_kernel_available():
        return F.linear(x, weight, bias)
    return _kernel(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and init) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
