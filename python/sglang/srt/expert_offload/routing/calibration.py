"""Calibrated expert probabilities for the `draft` predictor's prefetch cut.

A fixed rule, "fetch every row's top-(k + width)", fetches as many experts for a row the
predictor reads well (the draft's own residual) as for one it reads badly (a routing map, a row
one token back, the embedding estimate; docs/decisions.md), and ranks a pass's experts by
summed router scores, which mean different things from different sources. Here each (row
source, layer, predicted rank) learns online how often the expert ranked there is one the row
is then routed to. A row then says P(row uses e); the pass uses e with P = 1 - prod over its
rows of (1 - P(row uses e)); the prefetch fetches the experts with P at or above a cut,
likeliest first, and keeps those above half the cut from eviction, with P as the score the
store's swaps compare (slots.SWAP_MARGIN).

Rates are shrunk toward the same source's rate over all layers, and that toward a fixed prior
(top-k ranks mostly right), so a new server cuts sensibly from its first step.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

# Where a row's predicted residual came from (DraftPredictor): the draft's own residual of
# the token; the draft's residual of the token before it (the last drafted level, which the
# draft did not run); the target's previous residual with the embeddings swapped (or the
# embedding alone).
OWN, BACK, ESTIMATE = 0, 1, 2
SOURCES = ("own", "back", "estimate")


def prior_rates(num_experts: int, top_k: int) -> torch.Tensor:
    """[E] rate per rank before any observation: the top-k ranks 0.85 each, the rest of the
    k choices spread over the lower ranks, 80% of it on the next k. Sums to top_k (each row
    picks k experts) and never rises down the ranking."""
    rates = torch.ones(num_experts, dtype=torch.float64)
    rest = num_experts - top_k
    if rest <= 0:
        return rates
    rates[:top_k] = 0.85
    spare = 0.15 * top_k
    n_near = min(top_k, rest)
    tail = rest - n_near
    near = spare * (0.8 if tail else 1.0)
    rates[top_k : top_k + n_near] = near / n_near
    if tail:
        rates[top_k + n_near :] = (spare - near) / tail
    return rates


class RankCalibration:
    """Per (source, layer, rank): rows seen, and how many were routed to the expert the
    prediction ranked there."""

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int,
                 layer_weight: float = 8.0, pool_weight: float = 8.0) -> None:
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts, self.top_k = num_experts, top_k
        shape = (len(SOURCES), len(self.layers), num_experts)
        self.hits = torch.zeros(shape, dtype=torch.float64)
        self.rows = torch.zeros(shape[:2], dtype=torch.float64)
        self.prior = prior_rates(num_experts, top_k)
        self.layer_weight, self.pool_weight = layer_weight, pool_weight
        self._rates = None  # [S, L, E] cache, dropped on observe

    def rates(self) -> torch.Tensor:
        """[S, L, E]: P(a row of source s is routed at layer l to the expert ranked r)."""
        if self._rates is None:
            pooled = ((self.hits.sum(1) + self.pool_weight * self.prior)
                      / (self.rows.sum(1) + self.pool_weight)[:, None])  # [S, E]
            self._rates = ((self.hits + self.layer_weight * pooled[:, None, :])
                           / (self.rows + self.layer_weight)[..., None])
        return self._rates

    def observe(self, layer: int, scores: torch.Tensor, sources: torch.Tensor,
                topk_ids: torch.Tensor) -> None:
        """A pass ran `layer`: rows' predicted scores [n, E], their sources [n], and the
        experts each was routed to [n, k]."""
        if scores.shape[0] == topk_ids.shape[0]:
            self.observe_layers([layer], scores[None], sources, topk_ids[None])

    def observe_layers(self, layers: Sequence[int], scores: torch.Tensor,
                       sources: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """`observe` for several layers of one pass at once (scores [L', n, E], topk_ids
        [L', n, k]): a few batched ops instead of a few per layer (~0.13 ms each here)."""
        layers = [x for x in layers if x in self.index]
        n = scores.shape[1]
        if not layers or not n or len(layers) != scores.shape[0]:
            return
        order = scores.float().cpu().argsort(dim=-1, descending=True, stable=True)
        chosen = torch.zeros(order.shape, dtype=torch.float64).scatter_(
            2, topk_ids.cpu().long(), 1.0)
        by_rank = chosen.gather(2, order)  # [L', n, E]: was the rank-r expert chosen
        li = torch.tensor([self.index[x] for x in layers])
        # row (source s, layer l) of hits viewed as [S * L, E]
        flat = (sources.cpu().long()[None, :] * len(self.layers) + li[:, None]).reshape(-1)
        self.hits.view(-1, self.num_experts).index_add_(0, flat,
                                                        by_rank.reshape(-1, self.num_experts))
        self.rows.view(-1).index_add_(0, flat, torch.ones(flat.shape[0], dtype=torch.float64))
        self._rates = None

    def row_probs(self, layers: Sequence[int], scores: torch.Tensor,
                  sources: torch.Tensor) -> torch.Tensor:
        """[L', n, E]: each row's probability of using each expert, from scores [L', n, E]."""
        rates = self.rates()[:, [self.index[x] for x in layers]]  # [S, L', E]
        per_row = rates[sources.cpu().long()].permute(1, 0, 2)  # [L', n, E] by rank
        rank_of = scores.float().cpu().argsort(dim=-1, descending=True, stable=True).argsort(-1)
        return per_row.gather(2, rank_of)

    def pass_evidence(self, layers: Sequence[int], scores: torch.Tensor,
                      sources: torch.Tensor) -> torch.Tensor:
        """[L', E]: -log P(no row of the pass uses the expert) = -sum log(1 - P(row uses e)).
        Monotone in the pass probability, without its saturation at 1.0 in large passes
        (where it would leave popular experts tied and ranked by id)."""
        p = self.row_probs(layers, scores, sources).clamp(0.0, 1.0 - 1e-9)
        return -torch.log1p(-p).sum(1)

    def pass_probs(self, layers: Sequence[int], scores: torch.Tensor,
                   sources: torch.Tensor) -> torch.Tensor:
        """[L', E]: probability the pass (all rows) uses each expert at each layer."""
        return 1.0 - torch.exp(-self.pass_evidence(layers, scores, sources))

    def to_dict(self) -> Dict[str, List[float]]:
        """Mean rate per rank over layers, per source: what /server_info can show."""
        rates = self.rates().mean(1)
        return {name: [round(v, 3) for v in rates[s].tolist()]
                for s, name in enumerate(SOURCES) if self.rows[s].sum() > 0}


def select(layers: Sequence[int], evidence: torch.Tensor, min_prob: float
           ) -> Tuple[Dict[int, List[int]], Dict[int, Dict[int, float]]]:
    """(fetch: layer -> experts with pass probability >= min_prob, likeliest first;
        keep: layer -> experts with it >= min_prob / 2 -> the probability) from
    RankCalibration.pass_evidence [L', E]."""
    fetch: Dict[int, List[int]] = {}
    keep: Dict[int, Dict[int, float]] = {}
    cut, keep_cut = -math.log1p(-min_prob), -math.log1p(-min_prob / 2)
    order = evidence.argsort(dim=-1, descending=True, stable=True).tolist()
    for layer, ranked, ev in zip(layers, order, evidence.tolist()):
        fetch[layer] = [e for e in ranked if ev[e] >= cut]
        keep[layer] = {e: 1.0 - math.exp(-ev[e]) for e in ranked if ev[e] >= keep_cut}
    return fetch, keep
