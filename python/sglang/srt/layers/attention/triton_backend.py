"""triton: the attention backend on sgl_kernel's Triton kernels (GPU; CPU only in tests).

Per batch, `init_forward_metadata` flattens every request's KV slot list (its req_to_token
row, or the `kv_indices` override of the draft's compressed view) into one index tensor
with offsets, and packs custom masks (tree verification, draft frontier) into the kernels'
tail-mask form. Every layer then runs one kernel: split-K decode attention when each
request computes one token under the plain causal mask, else extend attention (prefill,
chunked prefill, mixed batches, TARGET_VERIFY trees, DRAFT_EXTEND).

Same contract as torch_native: request i's new tokens are the last `extend_seq_lens[i]`
entries of its slot list; results match torch_native within float rounding.
On CPU tensors the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before
the first use): that is how tests check this backend without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.layers.attention.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch import ForwardBatch


def _import_kernels() -> ModuleType:
    """sgl_kernel.attention, installed or from the source checkout's sgl-kernel/ folder."""
    try:
        import sgl_kernel.attention as kernels

        return kernels
    except ImportError:
        pass
    here = os.path.abspath(__file__)
    for _ in range(6):  # .../python/sglang/srt/layers/attention/triton_backend.py -> repo
        here = os.path.dirname(here)
    kernel_dir = os.path.join(here, "sgl-kernel")
    if os.path.isdir(os.path.join(kernel_dir, "sgl_kernel")) and kernel_dir not in sys.path:
        sys.path.append(kernel_dir)
    try:
        import triton  # noqa: F401

        import sgl_kernel.attention as kernels
    except ImportError as e:
        raise ValueError(
            f"--attention-backend triton needs the `triton` and `sgl_kernel` packages ({e}); "
            "install triton, or use --attention-backend torch_native") from e
    return kernels


@dataclasses.dataclass
class TritonMetadata:
    """Per-batch tensors on the KV pool's device; valid until the next init."""

    use_decode: bool
    qo_indptr: torch.Tensor  # [B + 1] int64
    kv_indptr: torch.Tensor  # [B + 1] int64
    kv_indices: torch.Tensor  # [sum kv_len] int64
    max_extend_len: int
    num_kv_splits: int
    mask_flat: Optional[torch.Tensor] = None  # uint8, packed tail masks
    mask_indptr: Optional[torch.Tensor] = None  # [B + 1] int64
    mask_width: Optional[torch.Tensor] = None  # [B] int64, 0 = causal


def _indptr(lengths, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def _pack_tails(masks, tails, ext, device):
    """pack_custom_masks' layout from tails known on the host: each mask's last `tail`
    columns, sliced and joined on the device (nothing read back)."""
    parts = [m[:, m.shape[1] - w :].reshape(-1) for m, w in zip(masks, tails)
             if m is not None and w > 0]
    flat = (torch.cat(parts).to(torch.uint8) if parts
            else torch.zeros(1, dtype=torch.uint8, device=device))
    widths = [w if m is not None else 0 for m, w in zip(masks, tails)]
    sizes = [e * w for e, w in zip(ext, widths)]
    return (flat.to(device), _indptr(sizes, device),
            torch.tensor(widths, dtype=torch.int64).to(device))


class TritonAttnBackend(AttentionBackend):
    supports_graphs = True  # decode and verify batches (model_executor/cuda_graph_runner.py)

    def __init__(self) -> None:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "--attention-backend triton needs a CUDA device (on CPU its kernels run only "
                "in Triton's interpreter, TRITON_INTERPRET=1, which is for tests); "
                "use --attention-backend torch_native")
        self.kernels = _import_kernels()
        self.meta: Optional[TritonMetadata] = None
        self._graphs: dict = {}  # rows per request -> GraphMetadata (triton_graph.py)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        k_buf, _ = fb.token_to_kv_pool.get_kv(0)
        device = k_buf.device
        seq_lens, ext = list(fb.seq_lens_cpu), list(fb.extend_seq_lens_cpu)
        overrides = fb.kv_indices if fb.kv_indices is not None else [None] * len(seq_lens)
        kv_lens = [int(o.shape[0]) if o is not None else s for o, s in zip(overrides, seq_lens)]
        kv_indptr = _indptr(kv_lens, device)
        table = fb.req_to_token_pool.req_to_token
        if all(o is None for o in overrides) and table.device == device:
            kv_indices = self.kernels.gather_kv_indices(
                table, fb.req_pool_indices.to(device), kv_indptr, sum(kv_lens),
                max(kv_lens, default=0))
        else:
            rows = fb.pool_rows()
            parts = [(o if o is not None else table[r, :s]).to(device, torch.int64)
                     for o, r, s in zip(overrides, rows, seq_lens)]
            kv_indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64,
                                                                     device=device)
        masks = fb.custom_mask
        has_mask = masks is not None and any(m is not None for m in masks)
        meta = TritonMetadata(
            use_decode=not has_mask and all(e == 1 for e in ext),
            qo_indptr=_indptr(ext, device), kv_indptr=kv_indptr, kv_indices=kv_indices,
            max_extend_len=max(ext, default=0),
            num_kv_splits=self.kernels.default_num_kv_splits(
                len(ext), fb.token_to_kv_pool.num_kv_heads, max(kv_lens, default=0), device))
        if has_mask and fb.custom_mask_tails is not None:
            meta.mask_flat, meta.mask_indptr, meta.mask_width = _pack_tails(
                masks, fb.custom_mask_tails, ext, device)
        elif has_mask:  # tails unknown: packing finds them on the host
            meta.mask_flat, meta.mask_indptr, meta.mask_width = self.kernels.pack_custom_masks(
                masks, ext, kv_lens, device)
        self.meta = meta

    def forward(self, q, k, v, layer: "RadixAttention", fb: "ForwardBatch", save_kv_cache=True):
        pool = fb.token_to_kv_pool
        hd, vd = layer.head_dim, layer.v_head_dim
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc.to(k.device),
                        k.view(-1, layer.num_kv_heads, hd), v.view(-1, layer.num_kv_heads, vd))
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        q = q.view(-1, layer.num_heads, hd)
        meta = self.meta
        assert meta is not None, "init_forward_metadata must run before forward"
        if meta.use_decode:
            out = self.kernels.decode_attention(
                q, k_buf, v_buf, meta.kv_indptr, meta.kv_indices, layer.scaling,
                num_kv_splits=meta.num_kv_splits)
        else:
            out = self.kernels.extend_attention(
                q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                layer.scaling, meta.mask_flat, meta.mask_indptr, meta.mask_width,
                max_extend_len=meta.max_extend_len)
        return out.view(-1, layer.num_heads * vd)

    # ---- CUDA graphs: metadata in static buffers, filled outside the graph (triton_graph.py)

    def init_graph_state(self, tokens: int, max_bs: int, max_kv_tokens: int, device) -> None:
        """Buffers of the graph family with `tokens` rows per request (1: decode)."""
        from sglang.srt.layers.attention.triton_graph import GraphMetadata

        self._graphs[tokens] = GraphMetadata(self.kernels, tokens, max_bs, max_kv_tokens, device)

    def init_forward_metadata_capture(self, bs: int, tokens: int, num_kv_heads: int,
                                      max_kv_len: int) -> None:
        self.meta = self._graphs[tokens].capture(bs, num_kv_heads, max_kv_len)

    def init_forward_metadata_replay(self, fb: "ForwardBatch", bs: int, tokens: int) -> None:
        self.meta = self._graphs[tokens].fill(fb, bs)

    def graph_can_run(self, fb: "ForwardBatch", tokens: int) -> bool:
        """Whether the `tokens` family computes `fb`: whole req_to_token rows kept on the
        pool's device; decode: one token a request, causal; verify: trees of at most
        `tokens` nodes, or single tokens, beside each other."""
        table = fb.req_to_token_pool.req_to_token
        if fb.kv_indices is not None or table.device != fb.token_to_kv_pool.get_kv(0)[0].device:
            return False
        ext = fb.extend_seq_lens_cpu
        if tokens == 1:
            return fb.custom_mask is None and all(e == 1 for e in ext)
        masks = fb.custom_mask or [None] * len(ext)
        return all(e <= tokens and (m is not None or e == 1) for m, e in zip(masks, ext))
