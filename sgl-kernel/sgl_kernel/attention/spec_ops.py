"""Helpers the speculative path needs on a GPU: tree masks and KV compaction (Triton).

Both replace per-request Python loops (one small torch op per node or per layer) with one
launch for the whole batch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel.attention.common import MAX, check_launchable

_INT_OF_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _tree_mask_kernel(parents_ptr, tree_indptr_ptr, mask_indptr_ptr, mask_ptr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    rb = tl.program_id(1)
    base = tl.load(tree_indptr_ptr + b).to(tl.int64)
    n = tl.load(tree_indptr_ptr + b + 1).to(tl.int64) - base
    if rb * BLOCK_R >= n:
        return
    out_base = tl.load(mask_indptr_ptr + b).to(tl.int64)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    r_mask = rows < n
    cur = tl.where(r_mask, rows, -1).to(tl.int64)
    bits = tl.full([BLOCK_R, BLOCK_C], 0, dtype=tl.int32)
    # Walk every row's ancestor chain at once. `parent < node` is enforced (a parent that
    # is not smaller ends the chain), so the walk ends within n steps even on bad input.
    while tl.reduce(cur, 0, MAX) >= 0:
        bits = tl.where(cols[None, :] == cur[:, None], 1, bits)
        par = tl.load(parents_ptr + base + cur, mask=cur >= 0, other=-1).to(tl.int64)
        cur = tl.where((cur >= 0) & (par < cur), par, -1)
    tl.store(mask_ptr + out_base + rows[:, None] * n + cols[None, :], bits.to(tl.uint8),
             mask=r_mask[:, None] & (cols[None, :] < n))


def build_tree_mask(
    parents: torch.Tensor,  # [N] int, parent of each node inside its tree, -1 for the root
    tree_indptr: torch.Tensor,  # [B + 1] int, tree b is parents[indptr[b]:indptr[b+1]]
    max_tree_size: Optional[int] = None,  # host-side max n_b (avoids a device sync)
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (mask_flat uint8 [sum n_b^2], mask_indptr int64 [B+1], mask_width int64 [B]).

    Row i of tree b is 1 at i and at every ancestor of i (nodes are in topological order:
    parents[i] < i). The result plugs into `extend_attention` as a tree-verify mask (width
    n_b: the prefix before the tree is visible to every node). Contract:
    `sgl_kernel.reference.tree_mask_reference`."""
    check_launchable(_tree_mask_kernel, parents)
    sizes = (tree_indptr[1:] - tree_indptr[:-1]).to(torch.int64)
    bsz = sizes.numel()
    mask_indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=parents.device)
    mask_indptr[1:] = (sizes * sizes).cumsum(0)
    if max_tree_size is None:
        max_tree_size = int(sizes.max()) if bsz else 0
    total = int(mask_indptr[-1]) if bsz else 0
    mask = torch.empty(max(total, 1), dtype=torch.uint8, device=parents.device)
    if bsz and max_tree_size:
        block_c = max(16, triton.next_power_of_2(max_tree_size))
        block_r = max(1, min(16, 4096 // block_c))
        grid = (bsz, triton.cdiv(max_tree_size, block_r))
        _tree_mask_kernel[grid](parents, tree_indptr, mask_indptr, mask,
                                BLOCK_R=block_r, BLOCK_C=block_c)
    return mask[:total], mask_indptr, sizes


@triton.jit
def _move_rows_kernel(ptr_table, row_stride_ptr, row_elems_ptr, src_ptr, dst_ptr, num_pairs,
                      ELEM: tl.constexpr, BLOCK: tl.constexpr):
    buf = tl.program_id(0)
    chunk = tl.program_id(1)
    base = tl.load(ptr_table + buf).to(tl.pointer_type(ELEM))
    stride = tl.load(row_stride_ptr + buf)
    row_elems = tl.load(row_elems_ptr + buf)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    col_mask = offs < row_elems
    # Pairs run in order inside the program (each program owns a column chunk of one
    # buffer, so programs never touch the same element): sequential semantics, which makes
    # in-place compaction (dst[j] <= src[j], both increasing) safe.
    for j in range(num_pairs):
        s = tl.load(src_ptr + j).to(tl.int64)
        d = tl.load(dst_ptr + j).to(tl.int64)
        x = tl.load(base + s * stride + offs, mask=col_mask)
        tl.store(base + d * stride + offs, x, mask=col_mask)


def move_kv_slots(buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For each buffer [num_slots, ...] (a row = one slot, contiguous; one element size for
    all) copy row src[j] to row dst[j] for j = 0, 1, ... in order, in one launch for all
    buffers (every layer's K and V). Bit-exact. Contract:
    `sgl_kernel.reference.move_kv_slots_reference`."""
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0 or not buffers:
        return
    check_launchable(_move_rows_kernel, src)
    elem = buffers[0].element_size()
    for buf in buffers:
        assert buf.element_size() == elem, "move_kv_slots: buffers differ in element size"
        assert buf.device == src.device and buf[0].is_contiguous(), "rows must be contiguous"
    dev = src.device
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev)
    strides = torch.tensor([b.stride(0) for b in buffers], dtype=torch.int64, device=dev)
    row_elems = [b[0].numel() for b in buffers]
    rows = torch.tensor(row_elems, dtype=torch.int64, device=dev)
    block = min(128 if dev.type == "cpu" else 1024, max(16, triton.next_power_of_2(max(row_elems))))
    grid = (len(buffers), triton.cdiv(max(row_elems), block))
    _move_rows_kernel[grid](ptrs, strides, rows, src, dst, src.numel(),
                            ELEM=_INT_OF_SIZE[elem], BLOCK=block)
