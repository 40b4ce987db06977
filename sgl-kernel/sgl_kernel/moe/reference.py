"""Torch reference for fused MoE, plus the token alignment the Triton kernel consumes."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F


def fused_moe_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int, expert (or slot) ids into w13 / w2
) -> torch.Tensor:  # [T, H]
    """sum_k w[t, k] * down(silu(gate(x_t)) * up(x_t)) of expert ids[t, k], token by token,
    computed in float32; a pair with id -1 is left out (an expert not held here)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e].float() @ x
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += topk_weights[t, j].float() * (w2[e].float() @ act)
    return out.to(hidden.dtype)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Sort (token, k) pairs by expert and pad each expert's run to a multiple of block_m.

    Returns (sorted_pair_ids [P] int32, where padding holds T*k; block_experts [P / block_m]
    int32, the expert of each block; P). A pair id p is token p // k, choice p % k. Pairs
    with id -1 (experts not held here) are in no block."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]  # -1 sorts first: drop those pairs
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    block_experts = torch.empty(total // block_m, dtype=torch.int32, device=topk_ids.device)
    src, dst = 0, 0
    for e, (n, p) in enumerate(zip(counts.tolist(), padded.tolist())):
        if n == 0:
            continue
        sorted_ids[dst : dst + n] = order[src : src + n].to(torch.int32)
        block_experts[dst // block_m : (dst + p) // block_m] = e
        src += n
        dst += p
    return sorted_ids, block_experts, total


def moe_align_block_size_static(topk_ids: torch.Tensor, block_m: int,
                                num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` without a host sync (a GPU step must not wait for the host
    to learn how many pairs each expert got): the layout at its largest size, T*k pairs
    plus block_m - 1 padding rows per expert, in whole blocks; the blocks past the real
    end get expert -1 (the kernel skips them). Same pair order within each expert."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, dev = flat.numel(), flat.device
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))  # -1 sorts last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts[num_experts] = 0  # pairs held elsewhere take no rows
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_key = key[order]
    dst = padded_start[sorted_key] + torch.arange(num_pairs, device=dev) - start[sorted_key]
    dst = torch.where(sorted_key < num_experts, dst, torch.full_like(dst, rows))  # dropped
    sorted_ids = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[dst] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_experts = torch.searchsorted(padded_end[:num_experts].contiguous(), block_start,
                                       right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts,
                                torch.full_like(block_experts, -1)).to(torch.int32)
    return sorted_ids[:rows], block_experts
