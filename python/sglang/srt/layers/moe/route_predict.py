"""Running the target's routers ahead of time: which experts would these rows pick?

A predictor (prefetch.py) feeds residual streams it has or estimates to the routers of the
target's MoE layers and asks two questions per layer:
- fetch: the experts in some row's top-(k + extra), most router mass first: what to load;
- keep: the experts in some row's top-(k + extra + keep_extra): what a load must not evict.
  On the SmolLM2 pair, the draft's residual names 0.955 of the target's top-2 per layer and
  top-3 covers 0.995, so an expert outside every row's top-3 is all but surely idle in the
  coming pass, and one inside it is worth the slot it holds.

`RouterStack` answers for every layer at once: a few batched tensor ops instead of ~8 small
ones per layer (SmolLM2 has 30 MoE layers, and the draft asks after each of its forwards).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Set, Tuple

import torch


@dataclasses.dataclass
class RouterView:
    """What a predictor may run of MoE layer `layer`: its pre-MoE norm and its router."""

    layer: int
    norm: torch.nn.Module  # post_attention_layernorm: residual stream -> MoE input
    gate: torch.nn.Module  # Router: MoE input -> RoutingResult-like top-k
    top_k: int


def _scores(logits: torch.Tensor, gate: torch.nn.Module, bias: torch.Tensor = None) -> torch.Tensor:
    logits = logits.float()
    if gate.cfg.scoring == "sigmoid":  # DeepSeek-V3: the choice adds the bias
        scores = logits.sigmoid()
        return scores + bias.float() if bias is not None else scores
    return logits.softmax(-1)


def route_rank(view: RouterView, residual: torch.Tensor, extra: int) -> List[int]:
    """Experts ranked by summed router probability over the rows of `residual` [n, H],
    keeping each row's top-(k + extra)."""
    with torch.no_grad():
        weight = view.gate.weight.to(residual.dtype)
        logits = torch.nn.functional.linear(view.norm(residual), weight)
        scores = _scores(logits, view.gate, getattr(view.gate, "e_score_correction_bias", None))
        k = min(view.top_k + extra, scores.shape[-1])
        top = scores.topk(k, dim=-1)
        return _ranked(top.indices.reshape(1, -1), top.values.reshape(1, -1),
                       scores.shape[-1])[0]


def _ranked(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> List[List[int]]:
    """Per layer (row of `indices` [L, m]): the chosen experts, most summed score first.
    Chosen is tracked apart from the sum: sigmoid scores plus a correction bias can be <= 0."""
    rows = indices.shape[0]
    mass = torch.zeros(rows, num_experts).scatter_add_(1, indices, values.float())
    chosen = torch.zeros(rows, num_experts, dtype=torch.bool).scatter_(1, indices, True)
    mass = mass.masked_fill(~chosen, float("-inf"))
    order = torch.argsort(mass, dim=-1, descending=True, stable=True).tolist()
    return [o[:n] for o, n in zip(order, chosen.sum(-1).tolist())]


class RouterStack:
    """The routers of the views' layers, stacked: `rank` routes rows of every layer in one
    batched matmul. Layers with another expert count, top-k or scoring than the first are
    routed one by one (`route_rank`)."""

    def __init__(self, views: Dict[int, RouterView]) -> None:
        self.views = views
        first = views[min(views)] if views else None

        def same(v: RouterView) -> bool:
            return (v.top_k == first.top_k and v.gate.weight.shape == first.gate.weight.shape
                    and v.gate.cfg.scoring == first.gate.cfg.scoring)

        self.stacked = [layer for layer in sorted(views) if same(views[layer])]
        self.single = [layer for layer in sorted(views) if layer not in self.stacked]
        self._weights: Dict[torch.dtype, torch.Tensor] = {}  # dtype -> [L, E, H]
        biases = [getattr(views[layer].gate, "e_score_correction_bias", None)
                  for layer in self.stacked]
        self._bias = (torch.stack([b.detach().float() for b in biases])[:, None, :]
                      if biases and all(b is not None for b in biases) else None)

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        w = self._weights.get(dtype)
        if w is None:  # router weights never change after loading: stack once per dtype
            w = torch.stack([self.views[layer].gate.weight.detach().to(dtype)
                             for layer in self.stacked])
            self._weights[dtype] = w
        return w

    def rank(self, residuals: Dict[int, torch.Tensor], extra: int,
             keep_extra: int) -> Tuple[Dict[int, List[int]], Dict[int, Set[int]]]:
        """`residuals`: layer -> [n, H] rows (the same n for every layer). Returns
        (fetch: layer -> experts in some row's top-(k+extra), most mass first;
         keep: layer -> experts in some row's top-(k+extra+keep_extra))."""
        fetch: Dict[int, List[int]] = {}
        keep: Dict[int, Set[int]] = {}
        layers = [layer for layer in self.stacked if layer in residuals]
        with torch.no_grad():
            for layer in [x for x in self.single if x in residuals]:
                view = self.views[layer]
                fetch[layer] = route_rank(view, residuals[layer], extra)
                keep[layer] = set(route_rank(view, residuals[layer], extra + keep_extra))
            if not layers:
                return fetch, keep
            normed = torch.stack([self.views[layer].norm(residuals[layer]) for layer in layers])
            weight = self._weight(normed.dtype)
            if len(layers) != len(self.stacked):
                pick = torch.tensor([self.stacked.index(x) for x in layers])
                weight = weight.index_select(0, pick)
            logits = torch.bmm(normed, weight.transpose(1, 2))  # [L, n, E]
            gate = self.views[layers[0]].gate
            bias = None
            if self._bias is not None:
                bias = self._bias if len(layers) == len(self.stacked) else self._bias[pick]
            scores = _scores(logits, gate, bias)
            num_experts = scores.shape[-1]
            k = min(self.views[layers[0]].top_k + extra, num_experts)
            wide = min(k + keep_extra, num_experts)
            top = scores.topk(wide, dim=-1)  # sorted: the first k are the fetch top-k
            idx, val = top.indices, top.values
            ranked = _ranked(idx[..., :k].reshape(len(layers), -1),
                             val[..., :k].reshape(len(layers), -1), num_experts)
            kept = torch.zeros(len(layers), num_experts, dtype=torch.bool).scatter_(
                1, idx.reshape(len(layers), -1), True).tolist()
        for i, layer in enumerate(layers):
            fetch[layer] = ranked[i]
            keep[layer] = {e for e, on in enumerate(kept[i]) if on}
        return fetch, keep
