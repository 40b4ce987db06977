"""Activations used by the dense MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection (gate first, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [.., 2d] -> [.., d]
        if x.dim() == 2 and (ops := cpu_ops(x)) is not None:
            return ops.silu_and_mul(x)  # one pass instead of slice, silu, mul
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
