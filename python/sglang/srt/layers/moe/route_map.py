"""RoutingMap: the target's router logits from a draft of another width, learned online.

A draft as wide as the target hands the target's routers a residual stream they can read as
it is (DraftPredictor.use_draft_hidden). A draft of another width (Qwen2.5-Coder-0.5B, 896,
drafting for the 1.5B MoE, 1536) cannot; but its residual stream still says much about the
token in context. Per target MoE layer L, a ridge regression from the draft's residual at
the layer of the same depth fraction (plus a constant) to L's router logits. Offline on the
Qwen pair (1,024 tokens of legal text, tested on the last 256 after fitting on the 128-768
before): top-4 of 16 recall 0.73-0.76 (0.81-0.84 with one more expert, 0.87-0.90 with two),
against 0.64 from the previous token's own routing and 0.49 from the embedding estimate.

Samples come from the server's own work, no calibration pass: the target's prefill (and
plain decode) rows give (request, token index) -> logits per layer; the draft reads the
same tokens when it catches up, and its residuals at those indices complete the pairs. The
map solves again after every `refit` new pairs, and answers once it has `min_samples`.
Bounded: only the first MAX_ROWS tokens of a request are logged, and no more pairs after
`max_samples` (offline the recall levels off by ~256 pairs; the statistics are sums, 24
draft layers x 897^2 floats for the Qwen pair, and a pair costs ~40 MFLOP to add).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

MAX_ROWS = 256  # tokens per request a map learns from (the start of each prompt)


class RoutingMap:
    def __init__(self, layers: Sequence[int], draft_layer_of: Dict[int, int], draft_hidden: int,
                 num_experts: int, rel: float = 0.5, min_samples: int = 64, refit: int = 256,
                 max_samples: int = 2048, max_rows: int = MAX_ROWS) -> None:
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
    def collecting(self) -> bool:
        return self.samples < self.max_samples

    # ---- the target's side -----------------------------------------------------------------

    def begin_pass(self, rows: List[Tuple[str, int, int]]) -> None:
        """A target forward starts whose rows [offset, offset + n) are request rid's tokens
        from index `start` on, for each (rid, start, n) in `rows` (rows of other kinds, draft
        trees, are left out by the caller)."""
        self._pass = (rows, {}) if rows and self.collecting else None

    def note_logits(self, layer: int, logits: torch.Tensor) -> None:
        """Layer `layer`'s router logits [rows, E] of begin_pass's rows, entry after entry."""
        if self._pass is None or layer not in self._xty:
            return
        rows, got = self._pass
        got[layer] = logits.detach().float().cpu()  # the sums and solves live on the host
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
        y = torch.stack([t for _, t in picks])  # [n, L, E]
        for d in self._xtx:
            h = hidden[d]
            x = self._features(h.index_select(0, index.to(h.device)).float().cpu())
            self._xtx[d] += x.T @ x
            self._xty_for(d, x, y)
        self.samples += len(picks)
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
