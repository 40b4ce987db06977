"""Rotary position embedding (neox / Hugging Face "rotate_half" layout).

`RotaryEmbedding.cos_sin(positions)` is computed once per forward and shared by every layer;
`apply_rotary` rotates q and k in place of HF's `apply_rotary_pos_emb`. Frequencies follow
transformers' rope types `default`, `linear` and `llama3` exactly (same float32 arithmetic),
so logits match HF bit for bit in float32.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.linear import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from_config(config: Any) -> Dict[str, Any]:
    """The rope dict of a transformers config, v5 (`rope_parameters`) or v4 (`rope_theta` +
    `rope_scaling`) style. Always has `rope_type` and `rope_theta`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    # Old configs spell the key "type".
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 10000.0)
    return params


def compute_inv_freq(rotary_dim: int, params: Dict[str, Any], max_position: int) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, scaled as HF does for the rope type."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params.get("original_max_position_embeddings", max_position)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between smoothed.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds no parameters or buffers: safe to build on the meta device and load in place."""

    def __init__(self, head_dim: int, max_position: int, params: Dict[str, Any],
                 rotary_dim: Optional[int] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        # A plain attribute on the CPU (not a buffer), so meta-device construction and
        # `to_empty` cannot wipe it; moved lazily to the positions' device.
        self._inv_freq = compute_inv_freq(self.rotary_dim, params, max_position)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [num_tokens, rotary_dim], in `dtype` (HF casts to the activations')."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self._inv_freq  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos_sin: Tuple[torch.Tensor, torch.Tensor],
                 num_heads: int, head_dim: int, inplace: bool = False) -> torch.Tensor:
    """Rotate x [T, num_heads * head_dim]; returns a new tensor of the same shape, or with
    `inplace` (the caller owns x, e.g. its slice of a fused qkv output) may rotate x itself
    and return it: on CPU one sgl_kernel pass, bit-identical to the torch code below."""
    cos, sin = cos_sin  # [T, rotary_dim]
    if inplace and x.dim() == 2 and (ops := cpu_ops(x, cos, sin)) is not None:
        ops.rotary_embedding(x, num_heads, head_dim, cos, sin)
        return x
    x = x.view(-1, num_heads, head_dim)
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    if rot == head_dim:
        out = x * cos + _rotate_half(x) * sin
    else:  # partial rotary: only the first rot dims turn
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        out = torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
    return out.reshape(-1, num_heads * head_dim)
