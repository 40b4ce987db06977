"""Activations used by the dense MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate_up projection (gate first, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [.., 2d] -> [.., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
