"""torch_native: the reference attention backend, one SDPA call per request.

Written for the CPU (kernel paths, KV read in place as views or runs); on any other device
it takes only the device-agnostic path (gather + SDPA) and makes nothing on the host.

Request i's queries sit at positions prefix_i .. seq_len_i - 1; its keys are the KV slots
listed by `kv_indices[i]` or the first seq_len_i entries of its req_to_token row. The mask
is causal over positions unless the request carries a custom mask (tree verification).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.layers.attention.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch import ForwardBatch


_CAUSAL = torch.ones(0, dtype=torch.bool)  # marker: queries and keys aligned, plain causal
# Decode and verify (few query rows): grouped-query heads are folded into the query rows
# instead of SDPA's enable_gqa, which expands K and V per query head (docs/decisions.md);
# above this many rows (prefill chunks) the repeated mask would cost more than the expansion.
_FOLD_MAX_ROWS = 64


def _as_slice(idx: torch.Tensor):
    """`idx` as a slice when it is an ascending run of slots (the usual case: a request's
    slots are allocated together), so the per-layer KV read is a view, not a gather copy
    (same output; docs/decisions.md)."""
    n = int(idx.numel())
    if n == 0 or idx.dim() != 1 or not idx.is_cpu:  # reading the ends would sync a device
        return idx
    first, last = int(idx[0]), int(idx[-1])
    if last - first == n - 1 and (n == 1 or bool((idx[1:] - idx[:-1] == 1).all())):
        return slice(first, last + 1)
    return idx


# Decode and verify rows (at most this many per request) go to sgl_kernel's decode_attention
# when it is built: it reads each KV row in place through the slot list (no gather, any
# number of runs) and splits the keys over the threads, beating the folded SDPA
# (docs/decisions.md).
_KERNEL_MAX_ROWS = 16
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _decode_kernel():
    """sgl_kernel.cpu.decode_attention when built on this CPU, else None (torch paths)."""
    from sglang.srt.layers.linear import cpu_kernel_available, _import_cpu_kernels

    if not cpu_kernel_available():
        return None
    return _import_cpu_kernels().decode_attention


# A request's KV in a few ascending runs (a cached document + the question + its decode
# tokens; a verify tree's slots) is attended run by run and merged by log-sum-exp instead of
# gathered: at long context the gather copies as many bytes per layer as attention reads.
_MAX_RUNS = 8
# Below this many keys the gather is cheaper than a SDPA call per run plus the merge, whose
# cost is mostly fixed per call (docs/decisions.md).
_RUNS_MIN_KEYS = 2048


def _runs(idx) -> Optional[List[slice]]:
    """`idx` (a slot tensor of 2+ runs; one run is already a slice) as at most _MAX_RUNS
    ascending runs, else None (gather)."""
    if isinstance(idx, slice) or idx.dim() != 1 or idx.numel() < 2 or not idx.is_cpu:
        return None  # (the runs' merge calls a CPU-only attention op)
    breaks = ((idx[1:] - idx[:-1]) != 1).nonzero().flatten()
    if breaks.numel() + 1 > _MAX_RUNS:
        return None
    bounds = [0] + (breaks + 1).tolist() + [int(idx.numel())]
    vals = idx.tolist()
    return [slice(vals[a], vals[b - 1] + 1) for a, b in zip(bounds[:-1], bounds[1:])]


def _length(idx) -> int:
    return idx.stop - idx.start if isinstance(idx, slice) else int(idx.shape[0])


def _folded_gqa(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor,
                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of qi [H, ext, hd] over ki/vi [KVH, kv_len, d] with H = KVH * G: query head
    h reads KV head h // G, so the G heads of a group become G * ext rows of one query
    matrix per KV head (row g * ext + e), each row keeping its own mask row. -> [ext, H, vd]"""
    h, ext, hd = qi.shape
    kvh = ki.shape[0]
    g = h // kvh
    q = qi.reshape(kvh, g * ext, hd)
    m = None if mask is None else mask.repeat(g, 1)
    o = F.scaled_dot_product_attention(q.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                                       attn_mask=m, scale=scale)  # [1, KVH, G*ext, vd]
    return o[0].reshape(h, ext, -1).transpose(0, 1)


def _folded_gqa_runs(qi: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     runs: List[slice], mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """_folded_gqa over KV that lies in several runs of the pool (views, no gather): each
    run gives an output and its log-sum-exp, merged exactly as one softmax would."""
    h, ext, hd = qi.shape
    kvh = k_buf.shape[1]
    g = h // kvh
    q = qi.reshape(1, kvh, g * ext, hd)
    m = None if mask is None else mask.repeat(g, 1)
    outs, lses, col = [], [], 0
    for run in runs:
        n = run.stop - run.start
        k = k_buf[run].transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = v_buf[run].transpose(0, 1).unsqueeze(0).to(q.dtype)
        add = None
        if m is not None:
            part = m[:, col : col + n]
            add = torch.zeros(part.shape, dtype=q.dtype).masked_fill_(~part, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=add, scale=scale)[:2]
        if m is not None:  # a row that sees nothing in this run reports lse 0, not -inf
            lse = lse.masked_fill(~part.any(-1), float("-inf"))
        outs.append(o.float())
        lses.append(lse)
        col += n
    lse = torch.stack(lses)  # [runs, 1, KVH, G*ext]
    w = torch.softmax(lse, dim=0).unsqueeze(-1)  # each run's share of the row's softmax
    o = (torch.stack(outs) * w).sum(0).to(qi.dtype)  # [1, KVH, G*ext, vd]
    return o[0].reshape(h, ext, -1).transpose(0, 1)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self._kernel = _decode_kernel()
        self._kv_tensor: List[Optional[torch.Tensor]] = []  # slot lists for the kernel
        self._kv_idx: List[torch.Tensor] = []
        self._runs: List[Optional[List[slice]]] = []
        self._masks: List[Optional[torch.Tensor]] = []

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        rows = fb.pool_rows()
        table = fb.req_to_token_pool.req_to_token
        self._kv_idx, self._masks, self._runs, self._kv_tensor = [], [], [], []
        for i, (row, seq_len, ext) in enumerate(zip(rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu)):
            override = fb.kv_indices[i] if fb.kv_indices is not None else None
            idx = override if override is not None else table[row, :seq_len]
            self._kv_tensor.append(idx.to(torch.int64) if self._kernel is not None
                                   and ext <= _KERNEL_MAX_ROWS and idx.is_cpu else None)
            self._kv_idx.append(_as_slice(idx))
            # the kernel reads any runs in place; splitting into runs is for the SDPA path
            self._runs.append(_runs(self._kv_idx[-1]) if self._kv_tensor[-1] is None
                              and ext <= _FOLD_MAX_ROWS
                              and _length(self._kv_idx[-1]) >= _RUNS_MIN_KEYS else None)
            custom = fb.custom_mask[i] if fb.custom_mask is not None else None
            if custom is not None:
                mask = custom.to(idx.device)
            elif ext == 1:
                mask = None  # a single query attends to the whole prefix
            elif ext == _length(self._kv_idx[-1]):
                # no prefix: SDPA's own causal path skips the masked half (faster than a
                # boolean mask, bit-identical output; docs/decisions.md)
                mask = _CAUSAL
            else:
                kv_len = _length(self._kv_idx[-1])
                q_pos = torch.arange(kv_len - ext, kv_len, device=idx.device).unsqueeze(1)
                mask = torch.arange(kv_len, device=idx.device).unsqueeze(0) <= q_pos
            self._masks.append(mask)

    def forward(self, q, k, v, layer: "RadixAttention", fb: "ForwardBatch", save_kv_cache=True):
        pool = fb.token_to_kv_pool
        hd, vd = layer.head_dim, layer.v_head_dim
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc,
                        k.view(-1, layer.num_kv_heads, hd), v.view(-1, layer.num_kv_heads, vd))
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        q = q.view(-1, layer.num_heads, hd)
        out = q.new_empty((q.shape[0], layer.num_heads, vd))
        start = 0
        gqa = layer.num_heads != layer.num_kv_heads
        for i, ext in enumerate(fb.extend_seq_lens_cpu):
            idx = self._kv_idx[i]
            qi = q[start : start + ext].transpose(0, 1)  # [H, ext, hd]
            mask = self._masks[i]
            causal = mask is _CAUSAL
            if (self._kv_tensor[i] is not None and not causal and q.dtype in _KERNEL_DTYPES
                    and k_buf.dtype in _KERNEL_DTYPES and hd % 8 == 0 and vd % 8 == 0):
                out[start : start + ext] = self._kernel(
                    q[start : start + ext], k_buf, v_buf, self._kv_tensor[i], mask, layer.scaling)
                start += ext
                continue
            if self._runs[i] is not None and not causal:
                out[start : start + ext] = _folded_gqa_runs(qi, k_buf, v_buf, self._runs[i],
                                                            mask, layer.scaling)
                start += ext
                continue
            ki = k_buf[idx].transpose(0, 1).to(q.dtype)  # [KVH, kv_len, hd]
            vi = v_buf[idx].transpose(0, 1).to(q.dtype)
            if gqa and not causal and ext <= _FOLD_MAX_ROWS:
                out[start : start + ext] = _folded_gqa(qi, ki, vi, mask, layer.scaling)
                start += ext
                continue
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                attn_mask=None if causal else mask, is_causal=causal, scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[start : start + ext] = oi[0].transpose(0, 1)
            start += ext
        return out.view(-1, layer.num_heads * vd)
