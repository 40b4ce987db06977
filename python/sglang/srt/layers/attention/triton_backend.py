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


class TritonAttnBackend(AttentionBackend):
    supports_graphs = True  # decode batches (model_executor/cuda_graph_runner.py)

    def __init__(self) -> None:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "--attention-backend triton needs a CUDA device (on CPU its kernels run only "
                "in Triton's interpreter, TRITON_INTERPRET=1, which is for tests); "
                "use --attention-backend torch_native")
        self.kernels = _import_kernels()
        self.meta: Optional[TritonMetadata] = None
        self._graph_meta: dict = {}  # captured batch size -> its metadata on static buffers

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
        if has_mask:
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

    # ---- CUDA graphs: decode metadata in static buffers, filled outside the graph ----------

    def init_graph_state(self, max_bs: int, max_kv_tokens: int, device) -> None:
        """Buffers every captured decode graph reads its slot lists from."""
        self._g_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=device)
        self._g_kv_indices = torch.zeros(max_kv_tokens, dtype=torch.int64, device=device)
        self._g_qo_indptr = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self._graph_meta = {}

    def init_forward_metadata_capture(self, bs: int, num_kv_heads: int, max_kv_len: int,
                                      device) -> None:
        """Decode metadata of a `bs`-row graph: its split count fixed for the longest list
        (short lists leave splits empty); for the capture itself each row reads slot 0."""
        self._g_kv_indptr[: bs + 1].copy_(self._g_qo_indptr[: bs + 1])
        self._g_kv_indices[:bs].zero_()
        self.meta = self._graph_meta[bs] = TritonMetadata(
            use_decode=True, qo_indptr=self._g_qo_indptr[: bs + 1],
            kv_indptr=self._g_kv_indptr[: bs + 1], kv_indices=self._g_kv_indices,
            max_extend_len=1, num_kv_splits=self.kernels.default_num_kv_splits(
                bs, num_kv_heads, max_kv_len, torch.device(device)))

    def init_forward_metadata_replay(self, fb: "ForwardBatch", bs: int) -> None:
        """Fill the static buffers for `fb` (its rows first, padding rows read nothing),
        on the device and without a host read."""
        n = fb.batch_size
        indptr = self._g_kv_indptr
        lens = fb.seq_lens_cpu
        torch.cumsum(fb.seq_lens, 0, out=indptr[1 : n + 1])
        indptr[n + 1 : bs + 1] = indptr[n]  # padding rows: empty lists (zeros out)
        self.kernels.gather_kv_indices(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, indptr[: n + 1], sum(lens),
            max(lens, default=0), out=self._g_kv_indices)
        self.meta = self._graph_meta[bs]

    def graph_can_run(self, fb: "ForwardBatch") -> bool:
        """A batch the decode graphs compute: one token per request under the causal mask,
        over whole req_to_token rows kept on the pool's device."""
        table = fb.req_to_token_pool.req_to_token
        return (fb.kv_indices is None and fb.custom_mask is None
                and all(e == 1 for e in fb.extend_seq_lens_cpu)
                and table.device == fb.token_to_kv_pool.get_kv(0)[0].device)
