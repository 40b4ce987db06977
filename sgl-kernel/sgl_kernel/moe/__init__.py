"""Fused MoE: a Triton grouped-GEMM kernel and its torch reference.

`fused_moe_reference` (torch, any device) is the contract; `fused_moe` (Triton) must match
it. The engine runs `fused_moe_pairs` on CUDA (`--moe-runner-backend triton`, the default
there: `srt/layers/moe/experts.py`); its CPU path runs the CPU linear kernels.
Importing this package does not import triton; `fused_moe` imports it on first use.
"""

from sgl_kernel.moe.reference import (fused_moe_reference, moe_align_block_size,
                                      moe_align_block_size_static)


def fused_moe(*args, **kwargs):
    from sgl_kernel.moe.fused_moe_triton import fused_moe as _fused_moe

    return _fused_moe(*args, **kwargs)


def fused_moe_pairs(*args, **kwargs):
    from sgl_kernel.moe.fused_moe_triton import fused_moe_pairs as _pairs

    return _pairs(*args, **kwargs)


__all__ = ["fused_moe", "fused_moe_pairs", "fused_moe_reference", "moe_align_block_size",
           "moe_align_block_size_static"]
