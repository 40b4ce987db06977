"""The gated feed-forward block (SwiGLU) of Llama-style decoders and of shared experts."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in one projection (gate rows first);
    the intermediate features split over the TP ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
