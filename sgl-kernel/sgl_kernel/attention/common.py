"""Helpers shared by the attention kernels' launchers (no Triton kernels here).

The kernels compute in float32 whatever the storage dtype. On a GPU, bf16/fp16 operands go
to the tensor cores in their own dtype (fp32 accumulate); float32 operands use exact
("ieee") dots, so float32 results match a float32 reference to ~1e-6. Under Triton's CPU
interpreter every dot runs in float32: the interpreter mishandles bf16 arithmetic (it
multiplies the raw bits), so nothing may be computed in bf16 there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Kernels reduce with `tl.reduce(x, axis, SUM)` rather than `tl.sum(x, axis)`: the same
# code once compiled, but the interpreter runs `tl.sum` as a nested device function
# (milliseconds of set-up per call) while it maps these combine functions straight to numpy.
try:
    from triton.language.standard import _elementwise_max as MAX
    from triton.language.standard import _sum_combine as SUM
except ImportError:  # pragma: no cover - other Triton versions: correct, slower interpreter

    @triton.jit
    def SUM(a, b):
        return a + b

    @triton.jit
    def MAX(a, b):
        return tl.maximum(a, b)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(kernel, t: torch.Tensor) -> None:
    """Raise early with a message a user can act on when `t` cannot reach `kernel`."""
    is_interp = type(kernel).__name__ == "InterpretedFunction"
    if is_interp and type(tl.sum).__name__ != "InterpretedFunction":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its "
                           "library functions cannot run in the interpreter: set it before "
                           "the first `import triton` of the process")
    if t.device.type == "cpu" and not is_interp:
        raise RuntimeError(
            "Triton kernels need a CUDA device; CPU tensors run only in Triton's interpreter, "
            "which must be switched on (TRITON_INTERPRET=1) before sgl_kernel.attention is "
            "imported. On CPU use --attention-backend torch_native.")
    if t.device.type != "cpu" and is_interp:
        raise RuntimeError("TRITON_INTERPRET=1 was set when sgl_kernel.attention was imported, "
                           "so its kernels only accept CPU tensors")


def dot_dtype(dtype: torch.dtype, device: torch.device):
    """The dtype operands are cast to for tl.dot (see the module docstring)."""
    if device.type == "cpu":
        return tl.float32
    return _DOT_DTYPES.get(dtype, tl.float32)


def head_dim_blocks(d: int):
    """Split a head dim into a power-of-two main block and a power-of-two tail block
    (0 = none), each >= 16 for tl.dot: 128 -> (128, 0), 80 -> (64, 16), 576 -> (512, 64)."""
    if d <= 16:
        return 16, 0
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    return main, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))
