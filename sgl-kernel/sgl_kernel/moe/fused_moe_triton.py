"""Fused MoE in Triton: two grouped GEMMs over expert-sorted (token, choice) pairs.

1. pairs are sorted by expert and padded per expert to BLOCK_M, so every block of BLOCK_M
   rows belongs to one expert (`moe_align_block_size_static`: sized for the most padding,
   so no host sync; the blocks past the end have expert -1 and return at once);
2. `_moe_gemm_kernel` computes, per block and BLOCK_N columns, C[pair] = A[row(pair)] @ W[e]^T
   (rows of A are tokens for the first GEMM, pairs for the second), optionally times the
   pair's routing weight; padding rows are masked;
3. silu(gate) * up between the GEMMs, and the sum over k at the end, in torch.
Tested against `reference.fused_moe_reference` (TRITON_INTERPRET=1 on CPU, small shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sgl_kernel.moe.reference import moe_align_block_size_static


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_experts_ptr,
                     N, K, num_pairs, a_row_div,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the pairs (the layout is sized without a host sync)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # padding rows hold num_pairs
    valid = pair < num_pairs
    a_row = tl.where(valid, pair // a_row_div, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")  # fp32 stays fp32 (no TF32)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pair, mask=valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_experts: torch.Tensor, a_row_div: int, weights: torch.Tensor | None,
                  block_m: int, block_n: int, block_k: int) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, block_experts,
        n, k, out.shape[0], a_row_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe_pairs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                    block_m: int = 16, block_n: int = 32, block_k: int = 32) -> None:
    """out[t * k + j] = w[t, j] * expert(ids[t, j])(hidden[t]) in float32 for every pair with
    id >= 0; other rows of `out` ([T * k, H] float32) are left as they are. Each row is
    computed by one block whatever the other pairs are, so calls over disjoint subsets of
    the pairs (waves of a few resident experts) fill `out` exactly as one call over all."""
    t, k = topk_ids.shape
    inter = w13.shape[1] // 2
    sorted_ids, block_experts = moe_align_block_size_static(topk_ids, block_m, w13.shape[0])
    gate_up = hidden.new_empty((t * k, 2 * inter))
    _grouped_gemm(hidden, w13, gate_up, sorted_ids, block_experts, k, None, block_m, block_n, block_k)
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(hidden.dtype)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, out, sorted_ids, block_experts, 1, weights, block_m, block_n, block_k)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_m: int = 16,
              block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """Same contract as `fused_moe_reference`: hidden [T, H] -> [T, H]."""
    t, k = topk_ids.shape
    down = torch.zeros((t * k, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    fused_moe_pairs(hidden, w13, w2, topk_weights, topk_ids, down, block_m, block_n, block_k)
    return down.view(t, k, -1).sum(1).to(hidden.dtype)
