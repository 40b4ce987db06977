"""The attention backend interface shared by torch_native, triton and flashinfer.

A backend does two things per layer: write this step's K/V to `forward_batch.out_cache_loc`,
then attend each request's new queries over a list of KV slot indices with a causal mask
(or the request's custom mask, e.g. a draft tree). The draft's compressed context is just a
shorter index list in `forward_batch.kv_indices`: no KV is copied.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    # Whether decode batches may replay CUDA graphs on this backend (the graph hooks
    # init_graph_state / init_forward_metadata_capture / _replay / graph_can_run).
    supports_graphs = False

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-batch metadata once, before the layers run."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * v_head_dim]
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads * v_head_dim]
        ...


def create_attention_backend(name: str) -> AttentionBackend:
    from sglang.srt.registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS.load(name)()
