"""The triton backend's metadata for CUDA graphs: static buffers a captured forward reads,
filled before each replay outside the graph (model_executor/cuda_graph_runner.py).

One `GraphMetadata` per family of graphs: `tokens` rows per request, 1 for decode (the
split-K decode kernel, causal) or a tree's node budget T for verify (the extend kernel with
a T x T tail mask per request: every node sees its request's whole prefix, and inside the
tree what the request's own mask allows). A request with fewer rows than T, and a padding
request of the batch, fills the rest with rows that see no tree column: their outputs are
never read, and the padding rows' K/V go to slot 0.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Dict

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.triton_backend import TritonMetadata
    from sglang.srt.model_executor.forward_batch import ForwardBatch


class GraphMetadata:
    def __init__(self, kernels, tokens: int, max_bs: int, max_kv_tokens: int, device) -> None:
        self.kernels, self.tokens, self.device = kernels, tokens, torch.device(device)
        t = tokens
        i64 = dict(dtype=torch.int64, device=device)
        self.kv_indptr = torch.zeros(max_bs + 1, **i64)
        self.kv_indices = torch.zeros(max_kv_tokens, **i64)
        self.qo_indptr = torch.arange(0, max_bs * t + 1, t, **i64)
        if t > 1:
            self.mask_flat = torch.zeros(max_bs * t * t, dtype=torch.uint8, device=device)
            self.mask_indptr = torch.arange(0, max_bs * t * t + 1, t * t, **i64)
            self.mask_width = torch.full((max_bs,), t, **i64)
        self.metas: Dict[int, "TritonMetadata"] = {}

    def capture(self, bs: int, num_kv_heads: int, max_kv_len: int) -> "TritonMetadata":
        """The metadata of the `bs`-request graph (each request, for the capture itself,
        reads `tokens` entries of slot 0). Decode fixes its split count for the longest
        list: shorter lists leave splits empty."""
        from sglang.srt.layers.attention.triton_backend import TritonMetadata

        t = self.tokens
        self.kv_indptr[: bs + 1].copy_(self.qo_indptr[: bs + 1])
        self.kv_indices[: bs * t].zero_()
        if t == 1:
            meta = TritonMetadata(
                use_decode=True, qo_indptr=self.qo_indptr[: bs + 1],
                kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
                max_extend_len=1, num_kv_splits=self.kernels.default_num_kv_splits(
                    bs, num_kv_heads, max_kv_len, self.device))
        else:
            self.mask_flat[: bs * t * t].zero_()
            meta = TritonMetadata(
                use_decode=False, qo_indptr=self.qo_indptr[: bs + 1],
                kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
                max_extend_len=t, num_kv_splits=1, mask_flat=self.mask_flat,
                mask_indptr=self.mask_indptr[: bs + 1], mask_width=self.mask_width[:bs])
        self.metas[bs] = meta
        return meta

    def fill(self, fb: "ForwardBatch", bs: int) -> "TritonMetadata":
        """Write `fb`'s slot lists (and tree masks) into the buffers of the `bs` graph; the
        only host-to-device copy is a verify's list offsets, nothing is read back."""
        n, t = fb.batch_size, self.tokens
        table = fb.req_to_token_pool.req_to_token
        if t == 1:
            lens = fb.seq_lens_cpu
            torch.cumsum(fb.seq_lens, 0, out=self.kv_indptr[1 : n + 1])
            self.kv_indptr[n + 1 : bs + 1] = self.kv_indptr[n]  # padding: empty lists
            self.kernels.gather_kv_indices(table, fb.req_pool_indices, self.kv_indptr[: n + 1],
                                           sum(lens), max(lens, default=0), out=self.kv_indices)
            return self.metas[bs]
        prefix = fb.prefix_lens_cpu
        # a request's list: its prefix and T more table entries (its tree, then entries its
        # rows never see); a padding request's: T entries of slot 0
        lens = [p + t for p in prefix] + [t] * (bs - n)
        offsets = list(itertools.accumulate(lens, initial=0))
        self.kv_indptr[: bs + 1].copy_(torch.tensor(offsets, dtype=torch.int64))
        real = offsets[n]
        self.kernels.gather_kv_indices(table, fb.req_pool_indices, self.kv_indptr[: n + 1],
                                       real, max(lens[:n], default=0), out=self.kv_indices)
        self.kv_indices[real : offsets[bs]].zero_()
        mask = self.mask_flat[: bs * t * t].view(bs, t, t)
        mask.zero_()
        masks = fb.custom_mask or [None] * n
        for i, (m, e, p) in enumerate(zip(masks, fb.extend_seq_lens_cpu, prefix)):
            if m is None:  # a request decoding one token beside the trees
                mask[i, 0, 0] = 1
            else:  # the tree's own columns (its prefix columns are all visible)
                mask[i, :e, :e].copy_(m[:, p:])
        return self.metas[bs]
