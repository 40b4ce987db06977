"""Torch references for the kernels (the contract every fast kernel is tested against)."""

from __future__ import annotations

from typing import Optional

import torch


def paged_attention_reference(
    q: torch.Tensor,  # [ext, num_heads, head_dim] queries of one request
    k_buffer: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, num_kv_heads, v_head_dim]
    kv_indices: torch.Tensor,  # [kv_len] int64 slots this request attends over
    scale: float,
    mask: Optional[torch.Tensor] = None,  # [ext, kv_len] bool, True = attend; None = causal
) -> torch.Tensor:  # [ext, num_heads, v_head_dim]
    ext, heads, _ = q.shape
    k = k_buffer[kv_indices].float()
    v = v_buffer[kv_indices].float()
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [kv_len, heads, d]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    kv_len = k.shape[0]
    if mask is None:
        pos = torch.arange(kv_len - ext, kv_len).unsqueeze(1)
        mask = torch.arange(kv_len).unsqueeze(0) <= pos
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def linear_reference(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    weight: torch.Tensor,  # [N, K] float32 or bfloat16
    bias: Optional[torch.Tensor] = None,  # [N]
) -> torch.Tensor:  # [..., N] in x's dtype
    """x @ weight^T + bias with fp32 inputs and accumulation, rounded once to x's dtype:
    the contract of sgl_kernel.cpu.small_m_linear."""
    y = torch.nn.functional.linear(x.float(), weight.float(),
                                   None if bias is None else bias.float())
    return y.to(x.dtype)
