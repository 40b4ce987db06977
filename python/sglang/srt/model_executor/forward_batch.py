"""ForwardBatch: everything one model forward needs, as tensors.

A forward computes `extend_seq_lens[i]` new tokens for request i, whose KV already holds
`prefix_lens[i]` tokens. Decode is simply an extend of one token; TARGET_VERIFY is an
extend of a draft tree with a custom mask. The attention backend writes this step's K/V
to `out_cache_loc` and reads request i's KV from `req_to_token[req_pool_indices[i],
:seq_lens[i]]` unless `kv_indices` overrides it (the draft's compressed view).
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill / chunked prefill / mixed with 1-token decodes
    DECODE = auto()  # every request computes exactly one token
    TARGET_VERIFY = auto()  # a draft tree per request, tree mask
    DRAFT_EXTEND = auto()  # the draft model catching up on accepted tokens
    IDLE = auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64 (rotary positions)
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, KV length after this step (prefix + new)
    extend_seq_lens: torch.Tensor  # [bs] int64, new tokens per request
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots the new tokens are written to
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "KVPool"
    attn_backend: "AttentionBackend"
    # Python mirrors of the small per-request tensors (the CPU path loops over requests).
    seq_lens_cpu: List[int] = dataclasses.field(default_factory=list)
    extend_seq_lens_cpu: List[int] = dataclasses.field(default_factory=list)
    req_pool_indices_cpu: List[int] = dataclasses.field(default_factory=list)
    # Rows (into the flattened new tokens) whose logits are wanted; None = last token of
    # each request (EXTEND) or every token (DECODE, TARGET_VERIFY).
    logits_indices: Optional[torch.Tensor] = None
    # Per request, a [extend_len, seq_len] bool mask (True = may attend); None = causal.
    custom_mask: Optional[List[Optional[torch.Tensor]]] = None
    # Per masked request, how many trailing key columns its mask restricts (every column
    # before them is visible to every row: a tree's prefix), known on the host so a GPU
    # backend packs the tails without reading the masks back; None = find out.
    custom_mask_tails: Optional[List[int]] = None
    # Per request, KV slot indices to attend over instead of the req_to_token row
    # (length must equal seq_lens[i]); used for the draft's compressed context.
    kv_indices: Optional[List[Optional[torch.Tensor]]] = None
    # Draft forwards for expert prefetch: called with (layer id, residual stream [T, H]) at
    # every layer's MLP input (what a target's router reads); None = nobody listens.
    residual_hook: Optional[Callable[[int, torch.Tensor], None]] = None
    # EAGLE-3: target layers whose output hidden states the forward concatenates, in this
    # order, into `captured_hidden` [num_tokens, len * hidden] (models/llama_eagle3.py)
    capture_layers: Optional[List[int]] = None
    captured_hidden: Optional[torch.Tensor] = None

    def pool_rows(self) -> List[int]:
        """req_to_token rows as Python ints: the host mirror when the builder filled it (no
        device-to-host copy on a GPU), else read from the tensor."""
        return self.req_pool_indices_cpu or self.req_pool_indices.tolist()

    @property
    def prefix_lens_cpu(self) -> List[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_seq_lens_cpu)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def resolved_logits_indices(self) -> torch.Tensor:
        if self.logits_indices is not None:
            return self.logits_indices
        if self.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)
