"""Torch references for the kernels (the contract every fast kernel is tested against)."""

from __future__ import annotations

from typing import List, Optional, Sequence

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


def decode_attention_reference(
    q: torch.Tensor,  # [B, H, D] one query per request
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, DV]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,  # [nnz] int64
    scale: float,
) -> torch.Tensor:  # [B, H, DV] in q's dtype; an empty slot list gives zeros
    """Contract of sgl_kernel.attention.decode_attention (float32 math)."""
    ptr = kv_indptr.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v_buffer.shape[2]))
    for b in range(q.shape[0]):
        if ptr[b + 1] > ptr[b]:
            sees_all = torch.ones((1, ptr[b + 1] - ptr[b]), dtype=torch.bool, device=q.device)
            out[b] = paged_attention_reference(q[b : b + 1], k_buffer, v_buffer,
                                               kv_indices[ptr[b] : ptr[b + 1]], scale,
                                               sees_all)[0]
    return out


def extend_attention_reference(
    q: torch.Tensor,  # [T, H, D] new tokens, request-major
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, DV]
    qo_indptr: torch.Tensor,  # [B + 1]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,  # [nnz] int64; a request's new tokens are its last ext slots
    scale: float,
    masks: Optional[List[Optional[torch.Tensor]]] = None,  # per request [ext, kv_len] or None
) -> torch.Tensor:  # [T, H, DV] in q's dtype
    """Contract of sgl_kernel.attention.extend_attention: None = causal over positions
    (query j at key position kv_len - ext + j); a query row that sees no key gives zeros."""
    qp, kp = qo_indptr.tolist(), kv_indptr.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v_buffer.shape[2]))
    for b in range(len(qp) - 1):
        ext, kv_len = qp[b + 1] - qp[b], kp[b + 1] - kp[b]
        if ext == 0:
            continue
        mask = None if masks is None else masks[b]
        if mask is None:
            pos = torch.arange(kv_len - ext, kv_len).unsqueeze(1)
            mask = torch.arange(kv_len).unsqueeze(0) <= pos
        mask = mask.to(device="cpu", dtype=torch.bool)
        o = paged_attention_reference(q[qp[b] : qp[b + 1]], k_buffer, v_buffer,
                                      kv_indices[kp[b] : kp[b + 1]], scale,
                                      mask.to(q.device))
        o[~mask.any(1).to(q.device)] = 0  # softmax over nothing: zeros, as the kernel
        out[qp[b] : qp[b + 1]] = o
    return out


def tree_mask_reference(
    parents: List[List[int]],  # per tree: parent of each node, -1 for the root, parent < node
) -> List[torch.Tensor]:  # per tree [n, n] bool: row i is True at i and every ancestor
    """Contract of sgl_kernel.attention.build_tree_mask (one packed tensor per tree there)."""
    out = []
    for par in parents:
        n = len(par)
        mask = torch.zeros((n, n), dtype=torch.bool)
        for i, p in enumerate(par):
            if 0 <= p < i:
                mask[i] = mask[p]
            mask[i, i] = True
        out.append(mask)
    return out


def move_kv_slots_reference(buffers: Sequence[torch.Tensor], src: torch.Tensor,
                            dst: torch.Tensor) -> None:
    """Contract of sgl_kernel.attention.move_kv_slots: row src[j] -> row dst[j], j in order."""
    for buf in buffers:
        for s, d in zip(src.tolist(), dst.tolist()):
            buf[d] = buf[s].clone()
