"""Routers: token -> top-k experts and their combine weights.

One `RouterConfig` covers the families we serve:
- Mixtral / Qwen2-MoE / Qwen3-MoE: softmax over all experts, top-k, optional
  renormalisation of the k weights (`renormalize`).
- DeepSeek-V2: softmax, plain top-k ("greedy") or group-limited top-k (best `topk_group`
  groups by their max score), weights times `routed_scaling_factor`, no renormalisation.
- DeepSeek-V3: sigmoid scores; choice by score + `e_score_correction_bias` inside the best
  `topk_group` groups (a group's score is the sum of its two best members); weights are
  the uncorrected scores, renormalised, times `routed_scaling_factor`.
Invariant: `RoutingResult.topk_ids` are distinct expert ids per token, in [0, num_experts).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = False
    num_groups: Optional[int] = None  # grouped top-k when set (with topk_group)
    topk_group: Optional[int] = None
    group_score: str = "max"  # "max" (DeepSeek-V2) | "top2_sum" (DeepSeek-V3)
    scaling_factor: float = 1.0
    # Router logits in float32 from float32 weights (DeepSeek keeps the gate in fp32);
    # otherwise the logits are computed in the activations' dtype, as Mixtral/Qwen do.
    fp32_logits: bool = False
    correction_bias: bool = False  # a learned per-expert bias used only for the choice

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if self.num_groups:
            if self.num_experts % self.num_groups or not self.topk_group:
                raise ValueError("grouped top-k needs num_experts divisible by n_group and a topk_group")


@dataclasses.dataclass
class RoutingResult:
    topk_ids: torch.Tensor  # [T, k] int64 expert ids
    topk_weights: torch.Tensor  # [T, k] float32 combine weights
    router_logits: torch.Tensor  # [T, num_experts]


def select_experts(router_logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: Optional[torch.Tensor] = None) -> RoutingResult:
    """Top-k choice and weights from raw router logits [T, E] (see the module docstring)."""
    logits = router_logits.float()
    scores = logits.softmax(-1) if cfg.scoring == "softmax" else logits.sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups:
        t, e = choice.shape
        grouped = choice.view(t, cfg.num_groups, e // cfg.num_groups)
        if cfg.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        else:
            group_scores = grouped.max(-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        # Excluded experts can never win: -inf for biased sigmoid choices, 0 for softmax
        # probabilities (as DeepSeek-V2's reference; ties then resolve among kept groups).
        fill = float("-inf") if correction_bias is not None else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    topk_ids = choice.topk(cfg.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, topk_ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    if cfg.scaling_factor != 1.0:
        weights = weights * cfg.scaling_factor
    return RoutingResult(topk_ids, weights, router_logits)


class Router(nn.Module):
    """The gate: `weight` [E, hidden] (checkpoint name `gate.weight`), optional
    `e_score_correction_bias` [E]."""

    def __init__(self, hidden_size: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dtype = torch.float32 if cfg.fp32_logits else None
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype))
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, hidden: torch.Tensor) -> RoutingResult:  # hidden [T, H]
        if self.cfg.fp32_logits:
            logits = F.linear(hidden.float(), self.weight.float())
        else:
            logits = F.linear(hidden, self.weight.to(hidden.dtype))
        return select_experts(logits, self.cfg, self.e_score_correction_bias)
