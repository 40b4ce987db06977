"""Extend / tree-verify attention over KV slot index lists with a causal or custom mask.

Request b computes `ext_b = qo_indptr[b+1] - qo_indptr[b]` new tokens whose K/V are already
in the pool: they are the last `ext_b` entries of its slot list `kv_indices[kv_indptr[b] :
kv_indptr[b+1]]` (length `kv_len_b >= ext_b`). Query j therefore sits at key position
`kv_len_b - ext_b + j`.

Masks (packed by `pack_custom_masks`): `mask_width[b] == 0` means causal (query j sees keys
`<= kv_len_b - ext_b + j`). Otherwise the request's mask covers only its last
`W = mask_width[b]` key columns, row-major `[ext_b, W]` bytes at `mask_flat[mask_indptr[b]:]`
(1 = attend), and every key before `kv_len_b - W` is visible to every query. A draft tree is
`W = ext_b` (the prefix is seen whole, tree nodes see their ancestors); the draft's frontier
pass is `W = number of tree nodes with KV`; `W = kv_len_b` is a fully general mask.
A query row that sees no key outputs zeros.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel.attention.common import MAX, SUM, check_launchable, dot_dtype, head_dim_blocks

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    mask_ptr, mask_indptr_ptr, mask_width_ptr,
    sm_scale_log2, group, D, DV,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DOT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b).to(tl.int64)
    ext = tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - q_start
    if mb * BLOCK_M >= ext:
        return
    kvh = h // group
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - kv_start
    width = tl.load(mask_width_ptr + b).to(tl.int64)
    mask_base = tl.load(mask_indptr_ptr + b).to(tl.int64)
    tail_start = kv_len - width  # first key column the custom mask covers

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
    m_mask = offs_m < ext
    q_pos = kv_len - ext + offs_m  # key position of each query
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=m_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    q = q.to(tl.float32).to(DOT)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + offs_d2[None, :], mask=m_mask[:, None] & (offs_d2[None, :] < D),
                     other=0.0)
        q2 = q2.to(tl.float32).to(DOT)

    # Causal: keys after this tile's last query are never visible.
    hi = kv_len
    if width == 0:
        hi = tl.minimum(kv_len, kv_len - ext + (mb + 1) * BLOCK_M)
    # Last key each query may see: itself when causal; any key under a custom mask.
    q_last = tl.where(width == 0, q_pos, kv_len)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slot = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        k_cols = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh
        kt = tl.load(k_cols + offs_d[:, None], mask=n_mask[None, :] & (offs_d[:, None] < D),
                     other=0.0)
        s = tl.dot(q, kt.to(tl.float32).to(DOT), input_precision="ieee")  # [M, N]
        if BLOCK_D2 > 0:
            kt2 = tl.load(k_cols + offs_d2[:, None],
                          mask=n_mask[None, :] & (offs_d2[:, None] < D), other=0.0)
            s += tl.dot(q2, kt2.to(tl.float32).to(DOT), input_precision="ieee")
        # Branch-free on purpose (no bool tile yielded from an if: Triton 3.9 fails to lower
        # that for some tile shapes). Causal requests have width 0, so tail_start = kv_len
        # and no valid key is in the tail: the mask bytes are never read for them.
        visible = m_mask[:, None] & n_mask[None, :] & (offs_n[None, :] <= q_last[:, None])
        in_tail = offs_n >= tail_start
        col = tl.where(in_tail, offs_n - tail_start, 0)
        bits = tl.load(mask_ptr + mask_base + offs_m[:, None] * width + col[None, :],
                       mask=visible & in_tail[None, :], other=1)
        visible = visible & (bits != 0)
        s = tl.where(visible, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(tl.float32).to(DOT),
                                            input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))


def extend_config(d: int, dv: int, dtype: torch.dtype, on_cpu: bool) -> dict:
    """Block sizes and launch options of `_extend_kernel` (see decode_config)."""
    block_d, block_d2 = head_dim_blocks(d)
    block_dv = max(16, triton.next_power_of_2(dv))
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_DV=block_dv)
    wide = max(block_d + block_d2, block_dv) > 256
    fp32 = dtype == torch.float32
    block_m, block_n, stages = 64, 64, 2
    if fp32:
        block_n = 32
    if wide:
        block_m, block_n, stages = (32, 16, 1) if fp32 else (64, 32, 2)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_D2=block_d2,
                BLOCK_DV=block_dv, num_warps=4, num_stages=stages)


def pack_custom_masks(
    masks: Sequence[Optional[torch.Tensor]],  # per request [ext_b, kv_len_b] bool, or None
    ext_lens: Sequence[int],
    kv_lens: Sequence[int],
    device: Optional[torch.device] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (mask_flat uint8 [total], mask_indptr int64 [B+1], mask_width int64 [B]).

    None -> causal (width 0). A full mask is cut to its smallest tail: the leading columns
    that every row attends are dropped (the kernel treats them as visible). A mask that
    equals the causal one is still packed as given (cheap: its prefix is dropped too)."""
    flats: List[torch.Tensor] = []
    widths: List[int] = []
    for mask, ext, kv_len in zip(masks, ext_lens, kv_lens):
        if mask is None:
            widths.append(0)
            continue
        assert tuple(mask.shape) == (ext, kv_len), f"mask {tuple(mask.shape)} != {(ext, kv_len)}"
        mask = mask.to("cpu", torch.bool)
        all_rows = mask.all(0) if ext > 0 else torch.ones(kv_len, dtype=torch.bool)
        blocked = (~all_rows).nonzero()
        first = int(blocked[0]) if blocked.numel() else kv_len
        width = kv_len - first
        if width == 0:  # every query sees every key: still not causal, keep one column
            width = min(1, kv_len)
        widths.append(width)
        flats.append(mask[:, kv_len - width :].reshape(-1).to(torch.uint8))
    sizes = [0 if w == 0 else e * w for w, e in zip(widths, ext_lens)]
    indptr = torch.zeros(len(widths) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    flat = torch.cat(flats) if flats else torch.zeros(1, dtype=torch.uint8)
    if flat.numel() == 0:
        flat = torch.zeros(1, dtype=torch.uint8)  # never read; keeps the pointer valid
    width_t = torch.tensor(widths, dtype=torch.int64)
    if device is not None:
        flat, indptr, width_t = flat.to(device), indptr.to(device), width_t.to(device)
    return flat, indptr, width_t


def extend_attention(
    q: torch.Tensor,  # [T, H, D] new tokens of all requests, request-major
    k_buffer: torch.Tensor,  # [num_slots, KVH, D]
    v_buffer: torch.Tensor,  # [num_slots, KVH, DV]
    qo_indptr: torch.Tensor,  # [B + 1] int
    kv_indptr: torch.Tensor,  # [B + 1] int
    kv_indices: torch.Tensor,  # [nnz] int64
    sm_scale: float,
    mask_flat: Optional[torch.Tensor] = None,  # uint8, see pack_custom_masks
    mask_indptr: Optional[torch.Tensor] = None,  # [B + 1] int64
    mask_width: Optional[torch.Tensor] = None,  # [B] int64, 0 = causal
    max_extend_len: Optional[int] = None,  # host-side max ext_b (avoids a device sync)
    out: Optional[torch.Tensor] = None,  # [T, H, DV]
) -> torch.Tensor:  # [T, H, DV] in q's dtype
    """Attention of every new token over its request's slot list under the mask described
    in the module docstring. Contract: `sgl_kernel.reference.extend_attention_reference`."""
    check_launchable(_extend_kernel, q)
    total, heads, d = q.shape
    bsz = qo_indptr.numel() - 1
    kvh, dv = k_buffer.shape[1], v_buffer.shape[2]
    assert heads % kvh == 0 and k_buffer.shape[2] == d, "q/k head shapes disagree"
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    if out is None:
        out = q.new_empty((total, heads, dv))
    assert out.stride(2) == 1, "out's last dim must be contiguous"
    if total == 0 or bsz == 0:
        return out
    if mask_width is None:  # all causal
        mask_width = torch.zeros(bsz, dtype=torch.int64, device=q.device)
        mask_indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=q.device)
        mask_flat = torch.zeros(1, dtype=torch.uint8, device=q.device)
    if max_extend_len is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    cfg = extend_config(d, dv, q.dtype, q.device.type == "cpu")
    grid = (bsz, heads, triton.cdiv(max(max_extend_len, 1), cfg["BLOCK_M"]))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices,
        mask_flat, mask_indptr, mask_width,
        sm_scale * _LOG2E, heads // kvh, d, dv,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        DOT=dot_dtype(q.dtype, q.device), **cfg,
    )
    return out
