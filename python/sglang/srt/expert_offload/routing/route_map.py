"""RoutingMap: the target's router logits from a draft of another width, learned online.

A draft as wide as the target hands the target's routers a residual stream they can read as
it is (DraftPredictor.use_draft_hidden). A draft of another width (Qwen2.5-Coder-0.5B, 896,
drafting for the 1.5B MoE, 1536) cannot; but its residual stream still says much about the
token in context. Per target MoE layer L, a ridge regression from the draft's residual at
the layer of the same depth fraction (plus a constant) to L's router logits.

The map is only as good as its pairs are many: its recall keeps rising well past a few
hundred pairs (docs/decisions.md), hence pairs from both prompts and verifies.

Samples come from the server's own work, no calibration pass:
- prompts: the target's prefill (and plain decode) rows give (request, token index) ->
  logits per layer; the draft reads the same tokens when it catches up, and its residuals
  at those indices complete the pairs (the first MAX_ROWS tokens of each request);
- verifies: a draft token the draft computed itself is routed by the target's verify pass
  in the same context (its tree ancestors), so its residual and those logits are a pair at
  once, drawn from the very rows the map predicts.
The map solves again after every `refit` new pairs, and answers once it has `min_samples`.
Bounded: no more pairs after `max_samples` (the statistics are sums, 24 draft layers x 897^2
floats for the Qwen pair; a pair costs ~40 MFLOP to add, a solve ~0.3 s on 2 cores).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.utils import host_sync

MAX_ROWS = 1024  # prompt tokens per request a map learns from (the start of each prompt)


class RoutingMap:
    def __init__(self, layers: Sequence[int], draft_layer_of: Dict[int, int], draft_hidden: int,
                 num_experts: int, rel: float = 0.5, min_samples: int = 64, refit: int = 256,
                 max_samples: int = 4096, max_rows: int = MAX_ROWS) -> None:
        self.layers = list(layers)
        self.draft_layer_of = dict(draft_layer_of)  # target layer -> draft layer
        self.num_experts = num_experts
        self.rel = rel  # ridge strength, relative to the mean diagonal of X^T X
        self.min_samples, self.refit = min_samples, refit
        self.max_samples, self.max_rows = max_samples, max_rows
        dim = draft_hidden + 1  # features: the residual and a constant
        self._xtx = {d: torch.zeros(dim, dim) for d in set(self.draft_layer_of.values())}
        self._xty = {layer: torch.zeros(dim, num_experts) for layer in self.layers}
        self.samples = 0
        self._at_fit = 0
        self.weight: Optional[torch.Tensor] = None  # [L, dim, E], rows of self.layers
        # rid -> {token index: [L, E] target logits} waiting for the draft's residuals
        self._pending: Dict[str, Dict[int, torch.Tensor]] = {}
        self._pass: Optional[Tuple[List[Tuple[str, int, int]], Dict[int, torch.Tensor]]] = None

    @property
    def ready(self) -> bool:
        return self.weight is not None

    @property
    def draft_layers(self) -> List[int]:
        return list(self._xtx)

    @property
    def collecting(self) -> bool:
        return self.samples < self.max_samples

    # ---- the target's side -----------------------------------------------------------------

    def begin_pass(self, rows: List[Tuple[str, int, int]],
                   drafted: Optional[Dict[int, torch.Tensor]] = None) -> None:
        """A target forward starts whose first logged rows are request rid's tokens from
        index `start` on, n of them, for each (rid, start, n) in `rows`, in that order; their
        pairs wait for the draft's catch-up (rows of draft trees are not among them).
        `drafted` ({draft layer: [m, H_draft]}): m more logged rows after those, tokens the
        draft itself proposed for this pass (a verify's draft rows), whose residuals it
        computed in the same context: each is a pair as soon as the target's logits arrive.
        The caller hands note_logits the logged rows only, in this order."""
        live = bool(rows or drafted) and self.collecting
        self._pass = (rows, {}, drafted) if live else None

    def note_logits(self, layer: int, logits: torch.Tensor) -> None:
        """Layer `layer`'s router logits [rows, E] of begin_pass's logged rows."""
        if self._pass is None or layer not in self._xty:
            return
        rows, got, drafted = self._pass
        # the sums and solves live on the host
        got[layer] = host_sync.to_cpu(logits.detach().float(), "route_map_logits")
        if len(got) < len(self.layers):
            return
        self._pass = None  # every layer seen: file the rows under their requests
        stack = torch.stack([got[x] for x in self.layers], dim=1)  # [rows, L, E]
        off = 0
        for rid, start, n in rows:
            pending = self._pending.setdefault(rid, {})
            for i in range(n):
                if len(pending) >= self.max_rows:
                    break
                pending[start + i] = stack[off + i]
            off += n
        if drafted is not None:
            self._add({d: host_sync.to_cpu(h.float(), "route_map_hidden")
                       for d, h in drafted.items()}, stack[off:])

    # ---- the draft's side ------------------------------------------------------------------

    def note_draft(self, rids: List[str], indices: List[int],
                   hidden: Dict[int, torch.Tensor]) -> None:
        """The draft computed rows (rids[i], token index indices[i]) with residuals
        hidden[draft layer][i]: pair the ones the target logged."""
        picks = [(i, self._pending[rid].pop(idx)) for i, (rid, idx) in
                 enumerate(zip(rids, indices)) if idx in self._pending.get(rid, ())]
        if not picks or not self.collecting or any(d not in hidden for d in self._xtx):
            return
        index = torch.tensor([i for i, _ in picks])
        self._add({d: host_sync.to_cpu(
            hidden[d].index_select(0, index.to(hidden[d].device)).float(), "route_map_hidden")
            for d in self._xtx}, torch.stack([t for _, t in picks]))

    def _add(self, hidden: Dict[int, torch.Tensor], y: torch.Tensor) -> None:
        """Pairs: draft residuals {draft layer: [n, H]} (every layer of the map's, on the
        host) -> logits [n, L, E]."""
        if not self.collecting or y.shape[0] == 0:
            return
        for d in self._xtx:
            x = self._features(hidden[d])
            self._xtx[d] += x.T @ x
            self._xty_for(d, x, y)
        self.samples += y.shape[0]
        if self.samples >= self.min_samples and (
                self.weight is None or self.samples - self._at_fit >= self.refit
                or not self.collecting):  # the last pairs it takes: solve with them
            self.fit()

    def _xty_for(self, d: int, x: torch.Tensor, y: torch.Tensor) -> None:
        for j, layer in enumerate(self.layers):
            if self.draft_layer_of[layer] == d:
                self._xty[layer] += x.T @ y[:, j]

    @staticmethod
    def _features(h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h.float(), torch.ones(h.shape[0], 1)], dim=1)

    def fit(self) -> None:
        """Solve the ridge regressions from the sums so far."""
        solved: Dict[int, torch.Tensor] = {}
        dim = next(iter(self._xtx.values())).shape[0]
        for d, xtx in self._xtx.items():
            xtx = xtx.double()
            ridge = self.rel * float(xtx.diagonal().mean()) + 1e-6
            solved[d] = torch.linalg.cholesky(xtx + ridge * torch.eye(dim, dtype=xtx.dtype))
        self.weight = torch.stack([
            torch.cholesky_solve(self._xty[layer].double(), solved[self.draft_layer_of[layer]])
            for layer in self.layers]).float()
        self._at_fit = self.samples

    # ---- prediction -------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor, layers: Optional[List[int]] = None) -> torch.Tensor:
        """hidden [L, n, H_draft] (row j: the draft layer of layers[j], default self.layers)
        -> predicted router logits [L, n, E]."""
        x = torch.cat([hidden.float(), torch.ones(*hidden.shape[:2], 1, device=hidden.device)],
                      dim=2)
        if self.weight.device != hidden.device:  # a GPU draft: keep a copy beside it
            self.weight = self.weight.to(hidden.device)
        weight = self.weight
        if layers is not None and layers != self.layers:
            weight = weight[[self.layers.index(y) for y in layers]]
        return torch.bmm(x, weight)

    def forget(self, rid: str) -> None:
        self._pending.pop(rid, None)
