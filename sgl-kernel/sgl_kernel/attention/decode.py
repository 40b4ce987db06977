"""Decode attention over KV slot index lists, split-K over long contexts (Triton).

One query token per request attends over the KV slots `kv_indices[kv_indptr[b] :
kv_indptr[b + 1]]` (in order; the list may be any subset of the pool, e.g. the draft's
compressed view). Stage 1 cuts each request's list into `num_kv_splits` pieces so a long
context spreads over many programs; each program handles all query heads that share one KV
head (GQA/MQA: the K/V tile is read once for the group) and writes a partial output plus
its log-sum-exp. Stage 2 merges the pieces. A request with an empty list gets zeros.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.attention.common import MAX, SUM, check_launchable, dot_dtype, head_dim_blocks

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, mid_o_ptr, mid_lse_ptr, o_ptr,
    sm_scale_log2, num_splits, group, D, DV,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DOT: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_group = (group + BLOCK_H - 1) // BLOCK_H
    kvh = hb // blocks_per_group
    first = (hb % blocks_per_group) * BLOCK_H
    offs_g = first + tl.arange(0, BLOCK_H)  # head index inside the group
    h_mask = offs_g < group
    heads = kvh * group + offs_g

    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - kv_start
    # Split boundaries are multiples of BLOCK_N so only a split's last tile is partial.
    per_split = (kv_len + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=h_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    q = q.to(tl.float32).to(DOT)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + offs_d2[None, :], mask=h_mask[:, None] & (offs_d2[None, :] < D),
                     other=0.0)
        q2 = q2.to(tl.float32).to(DOT)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: no inf - inf on empty rows
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_DV], 0.0, dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slot = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        k_cols = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh  # [1, N] -> K^T tile
        kt = tl.load(k_cols + offs_d[:, None], mask=n_mask[None, :] & (offs_d[:, None] < D),
                     other=0.0)
        s = tl.dot(q, kt.to(tl.float32).to(DOT), input_precision="ieee")  # [H, N]
        if BLOCK_D2 > 0:
            kt2 = tl.load(k_cols + offs_d2[:, None],
                          mask=n_mask[None, :] & (offs_d2[:, None] < D), other=0.0)
            s += tl.dot(q2, kt2.to(tl.float32).to(DOT), input_precision="ieee")
        s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(tl.float32).to(DOT),
                                            input_precision="ieee")
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    out_mask = h_mask[:, None] & (offs_dv[None, :] < DV)
    if DIRECT:  # one split: this is the final output, no merge pass
        tl.store(o_ptr + b * stride_fb + heads[:, None] * stride_fh + offs_dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2
        tl.store(mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
                 + offs_dv[None, :], out, mask=out_mask)
        tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, num_splits, DV,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.reduce(lse, 0, MAX)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0 -> output 0
    w = tl.exp2(lse - m)  # [S]
    parts = tl.load(mid_o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                    + offs_dv[None, :], mask=s_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    total = tl.reduce(w, 0, SUM)
    out = tl.reduce(parts * w[:, None], 0, SUM) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + b * stride_fb + h * stride_fh + offs_dv, out.to(o_ptr.dtype.element_ty),
             mask=offs_dv < DV)


def decode_config(group: int, d: int, dv: int, dtype: torch.dtype, on_cpu: bool) -> dict:
    """Block sizes and launch options of `_decode_split_kernel` (one place, so tests can
    compile exactly what runs). GPU tiles are sized for Hopper's 227 KiB of shared memory:
    float32 and wide heads (MLA: 512 + 64) get smaller tiles and one pipeline stage."""
    block_d, block_d2 = head_dim_blocks(d)
    block_dv = max(16, triton.next_power_of_2(dv))
    block_h = max(16, min(64, triton.next_power_of_2(group)))
    if on_cpu:  # the interpreter: a few loop trips, no launch options
        return dict(BLOCK_H=block_h, BLOCK_N=32, BLOCK_D=block_d, BLOCK_D2=block_d2,
                    BLOCK_DV=block_dv)
    wide = max(block_d + block_d2, block_dv) > 256
    fp32 = dtype == torch.float32
    block_n, stages = 64, 2
    if wide:
        block_n = 16 if fp32 else 32
        block_h = min(block_h, 16 if fp32 else 64)
        stages = 1 if fp32 else 2
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_D2=block_d2,
                BLOCK_DV=block_dv, num_warps=4, num_stages=stages)


def default_num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                          block_n: int = 64) -> int:
    """Enough splits to give a GPU ~2 programs per SM, never a split shorter than a tile."""
    if device.type == "cpu":
        return 1  # the interpreter pays per program: no merge pass (tests pass splits > 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(1, batch * num_kv_heads))
    return int(max(1, min(want, triton.cdiv(max(max_kv_len, 1), block_n), 64)))


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, DV] (may be a strided view, e.g. MLA)
    kv_indptr: torch.Tensor,  # [B + 1] int, request b reads kv_indices[indptr[b]:indptr[b+1]]
    kv_indices: torch.Tensor,  # [nnz] int64 KV slots
    sm_scale: float,
    num_kv_splits: Optional[int] = None,
    max_kv_len: Optional[int] = None,  # host-side max list length (avoids a device sync)
    out: Optional[torch.Tensor] = None,  # [B, H, DV]
) -> torch.Tensor:  # [B, H, DV] in q's dtype
    """softmax(q k^T * sm_scale) v per request and head over its slot list; H must be a
    multiple of KVH (query head h reads KV head h // (H // KVH)). Empty list -> zeros.
    Contract: `sgl_kernel.reference.decode_attention_reference`."""
    check_launchable(_decode_split_kernel, q)
    bsz, heads, d = q.shape
    kvh, dv = k_buffer.shape[1], v_buffer.shape[2]
    assert heads % kvh == 0 and k_buffer.shape[2] == d, "q/k head shapes disagree"
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    group = heads // kvh
    if out is None:
        out = q.new_empty((bsz, heads, dv))
    assert out.stride(2) == 1, "out's last dim must be contiguous"
    if bsz == 0:
        return out
    cfg = decode_config(group, d, dv, q.dtype, q.device.type == "cpu")
    block_h, block_dv = cfg["BLOCK_H"], cfg["BLOCK_DV"]
    if num_kv_splits is None:
        if max_kv_len is None:
            max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max())
        num_kv_splits = default_num_kv_splits(bsz, kvh, max_kv_len, q.device, cfg["BLOCK_N"])
    direct = num_kv_splits == 1
    mid_splits = 1 if direct else num_kv_splits  # the mid buffers are unused when direct
    mid_o = torch.empty((bsz, heads, mid_splits, dv), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, heads, mid_splits), dtype=torch.float32, device=q.device)
    grid = (bsz, kvh * triton.cdiv(group, block_h), num_kv_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse, out,
        sm_scale * _LOG2E, num_kv_splits, group, d, dv,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        DOT=dot_dtype(q.dtype, q.device), DIRECT=direct, **cfg,
    )
    if direct:
        return out
    _decode_merge_kernel[(bsz, heads)](
        mid_o, mid_lse, out, num_kv_splits, dv,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)), BLOCK_DV=block_dv,
    )
    return out
