"""CPU kernels (AVX2 + FMA, OpenMP), JIT-built on first use as a torch extension.

`small_m_linear(x, weight, bias)` computes x @ weight^T + bias reading the weight from DRAM
once per call whatever the number of rows of x, so verifying 8 speculative tokens costs
about what decoding one does (see benchmark/kernels/bench_cpu_linear.py).
The build is cached under ~/.cache/sglang-fork/sgl_kernel_build/<cpu+torch key>/; only the
first use with a fresh cache compiles (~1-2 min). Invariant: `is_available()` never raises;
when it is False (no compiler or ninja, no AVX2/FMA, build error) callers use torch instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from types import ModuleType
from typing import Optional

import torch

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("bindings.cpp", "small_m_linear.cpp", "decode_attention.cpp", "decode_attention_dp.cpp",
            "decode_attention_amx.cpp",
            "elementwise.cpp")
_EXT_NAME = "sgl_cpu_linear"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_error: Optional[str] = None


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _march() -> str:
    """-march for the build: the CPU's own, or SGL_KERNEL_MARCH (e.g. "haswell" to build and
    test the AVX2-only code on a CPU with AVX-512, as on a CI machine without it)."""
    return os.environ.get("SGL_KERNEL_MARCH", "native")


def build_dir() -> str:
    """Where the extension is built and cached: one folder per CPU flags + torch + Python
    (-march=native code only runs on CPUs like the one that built it) + source text (two
    checkouts of different versions, e.g. a benchmark's snapshot and a working tree, would
    otherwise rebuild over each other's build)."""
    flags = " ".join(sorted(_cpu_flags())) + f"|march={_march()}"
    src = hashlib.sha1()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as f:
            src.update(name.encode() + b"\0" + f.read())
    key = (f"{platform.machine()}|{flags}|{torch.__version__}|{sys.version_info[:2]}|"
           f"{src.hexdigest()}")
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "sglang-fork", "sgl_kernel_build",
                        digest)


def _load() -> Optional[ModuleType]:
    global _module, _error
    if _module is not None:  # the per-call path: no lock
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
            _error = "this CPU lacks AVX2 + FMA"
            return None
        try:
            from torch.utils.cpp_extension import load

            out = build_dir()
            os.makedirs(out, exist_ok=True)
            # torch's own build lock ("lock", made with O_EXCL) outlives a killed builder and
            # then makes every later process wait forever. An flock dies with its holder, so
            # whoever holds ours knows any torch lock it finds is stale and removes it.
            with open(os.path.join(out, "build.flock"), "a") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                try:
                    lock = os.path.join(out, "lock")
                    if os.path.exists(lock):
                        os.remove(lock)
                    # a first start compiles for 1-2 minutes: say so, or it looks like a hang
                    fresh = not any(f.endswith(".so") for f in os.listdir(out))
                    t0 = time.perf_counter()
                    if fresh:
                        logger.info("Building the CPU kernels (first use on this machine, "
                                    "1-2 min); cached in %s", out)
                    _module = load(
                        name=_EXT_NAME,
                        sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                        extra_cflags=["-O3", f"-march={_march()}", "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        build_directory=out,
                        verbose=False,
                    )
                    if fresh:
                        logger.info("CPU kernels built in %.0f s, cached in %s",
                                    time.perf_counter() - t0, out)
                finally:
                    fcntl.flock(guard, fcntl.LOCK_UN)
        except Exception as e:  # no compiler, no ninja, compile error: callers use torch
            _error = f"{type(e).__name__}: {e}"
            logger.warning("CPU kernels unavailable, torch's ops are used instead: %s",
                           _error.splitlines()[0][:300])
        return _module


def is_available() -> bool:
    """True when the kernel is built (building it now if needed) and runs on this CPU."""
    return _load() is not None


def unavailable_reason() -> Optional[str]:
    """Why `is_available()` is False (None when it is True or was not asked yet)."""
    return _error


def small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in x's dtype, fp32 accumulation.

    CPU tensors, each float32 or bfloat16 (mixed is fine). Any number of rows is correct; the
    weight is read from DRAM once per call. No autograd. Raises RuntimeError when the kernel
    is unavailable (check `is_available()` first).
    """
    mod = _load()
    if mod is None:
        raise RuntimeError(f"sgl_kernel CPU linear is unavailable: {_error}")
    if x.dim() == 2:
        return mod.small_m_linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])  # [M, K]
    return mod.small_m_linear(x2, weight, bias).reshape(*lead, weight.shape[0])


def linear_isa() -> str:
    """"avx512bf16" where small_m_linear runs bf16 x times bf16 W on VDPBF16PS (4x the
    multiply-adds of AVX2 per instruction), else "avx2"."""
    return _mod().linear_isa()


def attention_isa() -> str:
    """What decode_attention of bf16 q, K and V runs on: "amx-bf16" (both products on AMX
    tiles, head dims multiples of 32 up to 128), "avx512bf16" (VDPBF16PS, 16 query rows per
    instruction, K read as stored; also where AMX is absent or SGL_KERNEL_NO_AMX=1) or
    "avx2"."""
    return _mod().attention_isa()


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     idx: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of q [T, H, hd] over the pool rows k_buf[idx] / v_buf[idx] ([S, KVH, hd] /
    [S, KVH, vd], read in place: no gather), query head h reading KV head h // (H / KVH);
    mask: bool [T, L] (True = attend) or None. -> [T, H, vd] in q's dtype.

    For few query rows (decode, verify): keys are split across threads in fixed chunks, so a
    row's result depends only on its query, mask row and keys. A row that sees no key gets
    zeros. Raises RuntimeError when the kernel is unavailable (check `is_available()`).
    """
    mod = _load()
    if mod is None:
        raise RuntimeError(f"sgl_kernel CPU kernels are unavailable: {_error}")
    return mod.decode_attention(q, k_buf, v_buf, idx, mask, scale)


def _mod() -> ModuleType:
    mod = _load()
    if mod is None:
        raise RuntimeError(f"sgl_kernel CPU kernels are unavailable: {_error}")
    return mod


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None):
    """RMSNorm of x [M, D] as Hugging Face computes it (float32 statistics, the normalised row
    rounded to x's dtype, then times weight in that dtype). With `residual`: returns
    (norm(x + residual), x + residual), the sum rounded to x's dtype; else norm(x)."""
    out = _mod().rmsnorm(x, weight, eps, residual)
    return (out[0], out[1]) if residual is not None else out[0]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [M, 2d], each result rounded to x's dtype as torch's
    two ops would."""
    return _mod().silu_and_mul(x)


def rotary_embedding(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotate x [T, heads * head_dim] in place (rows may be strided, e.g. the q or k part of
    a fused qkv output): x * cos + rotate_half(x) * sin over the first cos.shape[1] dims of
    each head, cos / sin [T, rot] in x's dtype; bit-identical to the torch expression."""
    _mod().rotary_embedding(x, heads, head_dim, cos, sin)


__all__ = ["attention_isa", "build_dir", "decode_attention", "is_available", "linear_isa", "rmsnorm",
           "rotary_embedding", "silu_and_mul", "small_m_linear", "unavailable_reason"]
