"""RMSNorm with an optional fused residual add.

Numerics follow Hugging Face: normalise in float32, cast back to the input dtype, then
scale by the weight; the residual add happens in the model dtype. On CPU the whole op (add,
statistics, scaling) is one sgl_kernel call when it can take the tensors: ~10 torch ops
per norm cost more than the norm itself at decode time.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from sglang.srt.layers.linear import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if x.dim() == 2:
            ops = cpu_ops(x, self.weight) if residual is None else cpu_ops(x, self.weight, residual)
            if ops is not None:
                return ops.rmsnorm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
