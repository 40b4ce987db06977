"""Flatten requests' rows of the req_to_token table into one KV slot list (Triton).

This is the per-step metadata the attention kernels read: request b's slots are
`kv_indices[kv_indptr[b] : kv_indptr[b+1]]` = `req_to_token[req_pool_indices[b], :seq_len_b]`.
One launch replaces a boolean gather that would make the host wait for the device.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.attention.common import check_launchable


@triton.jit
def _gather_rows_kernel(table_ptr, rows_ptr, kv_indptr_ptr, out_ptr, stride_row,
                        BLOCK: tl.constexpr):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    n = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - start
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = tl.load(rows_ptr + b).to(tl.int64)
    slots = tl.load(table_ptr + row * stride_row + offs, mask=m, other=0)
    tl.store(out_ptr + start + offs, slots.to(tl.int64), mask=m)


def gather_kv_indices(
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_pool_indices: torch.Tensor,  # [B] int, rows of the table
    kv_indptr: torch.Tensor,  # [B + 1] int64, cumulative seq_lens
    total: int,  # kv_indptr[-1], known on the host
    max_len: Optional[int] = None,  # host-side max seq_len
    out: Optional[torch.Tensor] = None,  # int64, >= total entries: written in [:total]
) -> torch.Tensor:  # [total] int64 (`out` itself when given: a graph's static buffer)
    """Concatenate req_to_token[rows[b], :seq_len_b] for b in order. Contract:
    torch.cat([req_to_token[r, :n] for r, n in zip(rows, seq_lens)])."""
    check_launchable(_gather_rows_kernel, req_to_token)
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    if out is None:
        out = torch.empty(total, dtype=torch.int64, device=req_to_token.device)
    assert out.dtype == torch.int64 and out.numel() >= total, "out: int64, >= total entries"
    bsz = req_pool_indices.numel()
    if total == 0 or bsz == 0:
        return out
    if max_len is None:
        max_len = int((kv_indptr[1:] - kv_indptr[:-1]).max())
    block = 128 if req_to_token.device.type == "cpu" else 1024
    grid = (bsz, triton.cdiv(max(max_len, 1), block))
    _gather_rows_kernel[grid](req_to_token, req_pool_indices, kv_indptr, out,
                              req_to_token.stride(0), BLOCK=block)
    return out
