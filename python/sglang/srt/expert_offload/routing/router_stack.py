"""Running the target's routers ahead of time: which experts would these rows pick?

A predictor (predictors/) feeds residual streams it has or estimates to the routers of the
target's MoE layers and asks two questions per layer:
- fetch: the experts in some row's top-(k + extra), most router mass first: what to load;
- keep: the experts in some row's top-(k + extra + keep_extra), each with its router mass
  (summed over the rows that have it in that top): what a load must not evict, and how much
  each is worth. Top-(k + 1) covers nearly all of what a pass uses, so an expert outside it
  for every row is all but surely idle in the coming pass, and one inside it is worth the
  slot it holds unless a likelier one needs it (docs/decisions.md).

`RouterStack` answers for every layer at once: a few batched tensor ops instead of ~8 small
ones per layer (SmolLM2 has 30 MoE layers, and the draft asks after each of its forwards).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.layers.layernorm import RMSNorm


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


def _route_top(view: RouterView, residual: torch.Tensor, k: int):
    """Each row's top-k router scores of `residual` [n, H] (indices and values, [n, k])."""
    with torch.no_grad():
        weight = view.gate.weight.to(residual.dtype)
        logits = torch.nn.functional.linear(view.norm(residual), weight)
        scores = _scores(logits, view.gate, getattr(view.gate, "e_score_correction_bias", None))
        return scores.topk(min(k, scores.shape[-1]), dim=-1), scores.shape[-1]


def route_rank(view: RouterView, residual: torch.Tensor, extra: int) -> List[int]:
    """Experts ranked by summed router probability over the rows of `residual` [n, H],
    keeping each row's top-(k + extra)."""
    top, num_experts = _route_top(view, residual, view.top_k + extra)
    return _ranked(top.indices.reshape(1, -1), top.values.reshape(1, -1), num_experts)[0]


def _mass_chosen(indices: torch.Tensor, values: torch.Tensor, num_experts: int):
    """Per row of `indices` [L, m]: summed score per expert [L, E], and which were chosen.
    Chosen is tracked apart from the sum: sigmoid scores plus a correction bias can be <= 0."""
    rows = indices.shape[0]
    mass = torch.zeros(rows, num_experts).scatter_add_(1, indices, values.float())
    chosen = torch.zeros(rows, num_experts, dtype=torch.bool).scatter_(1, indices, True)
    return mass, chosen


def _masses(indices: torch.Tensor, values: torch.Tensor, num_experts: int
            ) -> List[Dict[int, float]]:
    """Per layer (row of `indices` [L, m]): chosen expert -> its summed score."""
    mass, chosen = _mass_chosen(indices, values, num_experts)
    return [{e: m for e, (m, on) in enumerate(zip(ms, cs)) if on}
            for ms, cs in zip(mass.tolist(), chosen.tolist())]


def _ranked(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> List[List[int]]:
    """Per layer (row of `indices` [L, m]): the chosen experts, most summed score first."""
    mass, chosen = _mass_chosen(indices, values, num_experts)
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
        self._index = {layer: i for i, layer in enumerate(self.stacked)}
        norms = [views[layer].norm for layer in self.stacked]
        # (weights [L, 1, H], eps) when every stacked norm is an RMSNorm with one eps
        self._rms: Optional[Tuple[torch.Tensor, float]] = None
        if norms and all(isinstance(m, RMSNorm) for m in norms) and \
                len({m.variance_epsilon for m in norms}) == 1:
            self._rms = (torch.stack([m.weight.detach() for m in norms])[:, None, :],
                         norms[0].variance_epsilon)
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

    def _normed(self, layers: List[int], pick: Optional[torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        """Each layer's pre-MoE norm of x [L, n, H]: RMSNorms (every model here) in four
        batched ops, any other norm layer by layer."""
        if self._rms is None:
            return torch.stack([self.views[layer].norm(x[i]) for i, layer in enumerate(layers)])
        weight, eps = self._rms
        if pick is not None:
            weight = weight.index_select(0, pick)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)  # as RMSNorm: the weight times the input-dtype rows

    def rank(self, residuals: Dict[int, torch.Tensor], extra: int,
             keep_extra: int) -> Tuple[Dict[int, List[int]], Dict[int, Dict[int, float]]]:
        """`residuals`: layer -> [n, H] rows (the same n for every layer). Returns
        (fetch: layer -> experts in some row's top-(k+extra), most mass first;
         keep: layer -> experts in some row's top-(k+extra+keep_extra) -> their mass)."""
        layers = [layer for layer in sorted(residuals) if layer in self.views]
        if not layers:
            return {}, {}
        return self.rank_stacked(layers, torch.stack([residuals[x] for x in layers]), extra,
                                 keep_extra)

    def _stacked_scores(self, stacked: List[int], layers: List[int],
                        x: torch.Tensor) -> torch.Tensor:
        """Router scores [len(stacked), n, E] of the rows x [len(layers), n, H] at the
        `stacked` layers among `layers`, in one batched matmul."""
        position = {layer: i for i, layer in enumerate(layers)}
        if stacked != layers:
            x = x.index_select(0, torch.tensor([position[y] for y in stacked], device=x.device))
        pick = None
        if len(stacked) != len(self.stacked):  # index_select wants its index on the device
            pick = torch.tensor([self._index[y] for y in stacked], device=x.device)
        normed = self._normed(stacked, pick, x)
        weight = self._weight(normed.dtype)
        if pick is not None:
            weight = weight.index_select(0, pick)
        logits = torch.bmm(normed, weight.transpose(1, 2))  # [L, n, E]
        bias = self._bias if self._bias is None or pick is None else self._bias[pick]
        return _scores(logits, self.views[stacked[0]].gate, bias)

    def stacked_scores(self, layers: List[int], x: torch.Tensor
                       ) -> Tuple[List[int], torch.Tensor]:
        """(the stacked layers among `layers`, their router scores [L', n, E]) of rows
        x [len(layers), n, H]."""
        stacked = [layer for layer in self.stacked if layer in layers]
        if not stacked:
            return [], x.new_zeros((0, x.shape[1], 0))
        with torch.no_grad():
            return stacked, self._stacked_scores(stacked, layers, x)

    def chosen(self, layers: List[int], x: torch.Tensor) -> torch.Tensor:
        """[len(layers), n, E] bool: the experts each row x [len(layers), n, H] would be
        routed to (its top-k) at each layer; E is the largest expert count among them."""
        num = max(self.views[layer].gate.weight.shape[0] for layer in layers)
        out = torch.zeros(len(layers), x.shape[1], num, dtype=torch.bool, device=x.device)
        if x.shape[1] == 0:
            return out
        with torch.no_grad():
            for i, layer in enumerate(layers):
                if layer in self.single:
                    view = self.views[layer]
                    top, _ = _route_top(view, x[i], view.top_k)
                    out[i].scatter_(1, top.indices, True)
            stacked, scores = self.stacked_scores(layers, x)
            if stacked:
                rows = torch.tensor([layers.index(y) for y in stacked], device=x.device)
                part = self.chosen_scores(stacked, scores)
                out[rows, :, : part.shape[-1]] = part
        return out

    def rank_stacked(self, layers: List[int], x: torch.Tensor, extra: int, keep_extra: int
                     ) -> Tuple[Dict[int, List[int]], Dict[int, Dict[int, float]]]:
        """`rank` of rows already stacked: x [len(layers), n, H], row i of `layers`."""
        fetch: Dict[int, List[int]] = {}
        keep: Dict[int, Dict[int, float]] = {}
        position = {layer: i for i, layer in enumerate(layers)}
        stacked = [layer for layer in self.stacked if layer in position]
        with torch.no_grad():
            for layer in [y for y in self.single if y in position]:
                view = self.views[layer]
                k = view.top_k + extra
                top, num_experts = _route_top(view, x[position[layer]], k + keep_extra)
                idx, val = top.indices, top.values  # sorted: the first k are the fetch top-k
                fetch[layer] = _ranked(idx[:, :k].reshape(1, -1), val[:, :k].reshape(1, -1),
                                       num_experts)[0]
                keep[layer] = _masses(idx.reshape(1, -1), val.reshape(1, -1), num_experts)[0]
            if not stacked:
                return fetch, keep
            scores = self._stacked_scores(stacked, layers, x)
        more_fetch, more_keep = self.rank_scores(stacked, scores, extra, keep_extra)
        fetch.update(more_fetch)
        keep.update(more_keep)
        return fetch, keep

    def scores_of(self, layers: List[int], logits: torch.Tensor) -> torch.Tensor:
        """Router scores [L, n, E] (what top-k picks from) of router logits [L, n, E]
        predicted some other way (route_map.RoutingMap)."""
        return torch.stack([_scores(logits[i], self.views[layer].gate,
                                    getattr(self.views[layer].gate, "e_score_correction_bias",
                                            None))
                            for i, layer in enumerate(layers)])

    def rank_scores(self, layers: List[int], scores: torch.Tensor, extra: int, keep_extra: int
                    ) -> Tuple[Dict[int, List[int]], Dict[int, Dict[int, float]]]:
        """fetch / keep (as `rank`) from router scores [len(layers), n, E] of layers with
        one top-k and expert count."""
        with torch.no_grad():
            num_experts = scores.shape[-1]
            k = min(self.views[layers[0]].top_k + extra, num_experts)
            wide = min(k + keep_extra, num_experts)
            top = scores.topk(wide, dim=-1)  # sorted: the first k are the fetch top-k
            idx, val = top.indices, top.values
            n = len(layers)
            ranked = _ranked(idx[..., :k].reshape(n, -1), val[..., :k].reshape(n, -1),
                             num_experts)
            kept = _masses(idx.reshape(n, -1), val.reshape(n, -1), num_experts)
        return dict(zip(layers, ranked)), dict(zip(layers, kept))

    def chosen_scores(self, layers: List[int], scores: torch.Tensor) -> torch.Tensor:
        """[L, n, E] bool: each row's top-k of router scores [L, n, E]."""
        k = min(self.views[layers[0]].top_k, scores.shape[-1])
        idx = scores.topk(k, dim=-1).indices
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(
            2, idx, True)
