"""Multi-head latent attention over the latent KV pool, through the attention backend.

In the absorbed form (DeepSeek-V2 §2.1.2) every head's query is moved into latent space:
`q_lat = [q_nope @ W_UK | q_pe]` ([T, H, kv_lora_rank + rope]), and every token's key is its
latent `[c_kv | k_pe]`, shared by all heads; the value is `c_kv`, the key's prefix. That is
plain multi-query attention with one KV head, `head_dim = kv_lora_rank + rope` and
`v_head_dim = kv_lora_rank`, so it runs on the configured backend unchanged: the backend
writes the latents to `out_cache_loc` in the MLA pool and attends over exactly the slot
lists it uses for every other model (`req_to_token` rows, `forward_batch.kv_indices`
overrides, causal or `custom_mask` tree masks). The model multiplies the result by W_UV.
Requires a pool whose `get_kv` returns (latents, latents[..., :kv_lora_rank])
(`mem_cache/mla_pool.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch import ForwardBatch


def mla_attention(q_latent: torch.Tensor, latent: torch.Tensor, layer: "RadixAttention",
                  forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
    """q_latent [T, H, r + rope], latent [T, r + rope] (this step's tokens) -> [T, H, r].

    `layer` must be a RadixAttention with num_kv_heads=1, head_dim=r + rope, v_head_dim=r."""
    t, heads, dim = q_latent.shape
    r = layer.v_head_dim
    assert layer.num_kv_heads == 1 and dim == layer.head_dim == latent.shape[-1], "MLA shapes"
    out = forward_batch.attn_backend.forward(
        q_latent.reshape(t, heads * dim), latent, latent[:, :r].contiguous(), layer,
        forward_batch, save_kv_cache)
    return out.view(t, heads, r)
