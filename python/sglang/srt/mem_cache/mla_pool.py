"""KV pool for multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token.

A token's entry is `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`: the normalised KV
latent and the rotated shared rope key, stored as a single "head". Attention reads it as
K and reads its first `kv_lora_rank` columns as V (see layers/attention/mla_attention.py),
so the pool keeps one buffer per layer and `get_kv` returns (buffer, view of its prefix).
Slot 0 is padding, as in `KVPool`. Per token it costs
`num_layers * (kv_lora_rank + qk_rope_head_dim)` elements instead of
`num_layers * 2 * num_heads * head_dim`.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from sglang.srt.distributed.parallel_state import kv_heads_per_rank
from sglang.srt.mem_cache.memory_pool import KVPool


def is_mla_config(config: Any) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_rope_head_dim")


class MLATokenToKVPool:
    """Per-layer latent buffers of shape [size + 1, 1, kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, size: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: str = "cpu") -> None:
        self.size = size
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.dtype = dtype
        self.device = device
        # torch.empty, as KVPool: pages are committed on first write; slot 0 is zeroed.
        self.kv_buffer = [torch.empty((size + 1, 1, self.head_dim), dtype=dtype, device=device)
                          for _ in range(num_layers)]
        for buf in self.kv_buffer:
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * elem

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor = None) -> None:
        """k: [n, 1, kv_lora_rank + rope] latents; v (a prefix view of k) is not stored."""
        self.kv_buffer[layer_id][loc] = k.reshape(-1, 1, self.head_dim).to(self.dtype)

    def get_kv(self, layer_id: int):
        buf = self.kv_buffer[layer_id]
        return buf, buf[..., : self.kv_lora_rank]

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the latents of slots `src` to slots `dst` in every layer (tree compaction)."""
        for buf in self.kv_buffer:
            buf[dst] = buf[src]


def _kv_heads(config: Any, tp_size: int) -> int:
    """KV heads one TP rank keeps (kv_heads_per_rank: split, or one replicated)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_heads_per_rank(heads, tp_size)


def kv_bytes_per_token(config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV bytes one token costs in the pool `create_kv_pool` builds for `config`."""
    if is_mla_config(config):
        return MLATokenToKVPool.bytes_per_token(config.num_hidden_layers, config.kv_lora_rank,
                                                config.qk_rope_head_dim, dtype)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVPool.bytes_per_token(config.num_hidden_layers, _kv_heads(config, tp_size),
                                  head_dim, dtype)


def create_kv_pool(config: Any, size: int, dtype: torch.dtype, device: str = "cpu",
                   tp_size: int = 1) -> Union[KVPool, MLATokenToKVPool]:
    """The KV pool a model of `config` needs on one TP rank: the latent pool for MLA, else a
    KVPool of the rank's KV heads."""
    if is_mla_config(config):
        return MLATokenToKVPool(size, config.num_hidden_layers, config.kv_lora_rank,
                                config.qk_rope_head_dim, dtype, device)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVPool(size, config.num_hidden_layers, _kv_heads(config, tp_size), head_dim, dtype,
                  device)
