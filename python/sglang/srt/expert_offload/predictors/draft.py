"""`draft`: route the pass's tokens, drafted ones included, before the pass runs."""

from __future__ import annotations

import collections
from typing import Dict, List, Optional, Set

import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.predictors.base import ExpertPredictor
from sglang.srt.expert_offload.routing.calibration import (BACK, ESTIMATE, OWN,
                                                           RankCalibration, select)
from sglang.srt.expert_offload.routing.router_stack import RouterStack, RouterView


class DraftPredictor(ExpertPredictor):
    """Route the pass's tokens (the drafted ones included) through the target's routers before
    the pass runs. A token's residual stream at layer L is estimated from the request's most
    recent processed token t: r_L(x) ~ r_L(t) - emb(t) + emb(x) (the context's contribution
    is shared; only the token's own embedding differs). With no history yet (a new request),
    the embedding alone stands in for the residual."""

    name = "draft"

    def __init__(self, views: Dict[int, RouterView], embed: torch.nn.Embedding, width: int,
                 keep_width: int = 1, min_prob: float = 0.0) -> None:
        self.views, self.embed, self.width = views, embed, width
        self.routers = RouterStack(views)
        # min_prob > 0: fetch the experts the pass uses with at least that probability, from
        # rates learned per row source / layer / rank (routing/calibration.py), instead of
        # every row's top-(k + width); 0: the fixed rule.
        self.min_prob = min_prob
        self.calibration: Optional[RankCalibration] = None
        if min_prob > 0 and self.routers.stacked:
            first = views[self.routers.stacked[0]]
            self.calibration = RankCalibration(self.routers.stacked,
                                               first.gate.weight.shape[0], first.top_k)
        # (layers, predicted scores [L', n, E], row sources [n]) of the pass about to run:
        # what the calibration scores against the routing, in one batch once every one of
        # those layers has run (`_routed`: layer -> its topk_ids so far)
        self._pass: Optional[tuple] = None
        self._routed: Dict[int, torch.Tensor] = {}
        # Experts in some row's top-(k + width + keep_width) are kept from eviction this step:
        # one rank past the fetch covers nearly all of what the pass uses (docs/decisions.md).
        self.keep_width = keep_width
        self.keep: Dict[int, Dict[int, float]] = {}  # layer -> kept expert -> router mass
        # rid -> (token id, {layer: residual [H]}) of the request's latest processed token
        self.state: Dict[str, tuple] = {}
        self._rows: Optional[List[tuple]] = None  # (rid, row) to keep from this pass
        self._num_rows = 0
        # With a draft sharing the target's residual stream (use_draft_hidden): target MoE
        # layer -> draft layer, and this step's draft residuals per request and token.
        self.layer_map: Dict[int, int] = {}
        # rid -> token -> residual per target layer [L, H] (rows of `hidden_layers`)
        self.drafted: Dict[str, Dict[int, torch.Tensor]] = {}
        self.latest: Dict[str, tuple] = {}  # rid -> (token, [L, H]) of its latest drafted row
        self.hidden_layers: List[int] = []  # the target layers the draft's residuals cover
        # A draft of another width: its residuals reach the routers through a learned map.
        self.routemap = None  # route_map.RoutingMap
        self._map_rows: Optional[tuple] = None  # (row index, rows in the pass) to log

    def use_draft_hidden(self, hidden_size: int, num_layers: int) -> bool:
        """A draft of the target's width reads, at each layer, a residual stream the
        target's router can take as it is when the two models share their lineage (an MoE
        upcycled from the draft, an EAGLE head on the target's features); it names the
        target's experts about twice as well as the estimate below (docs/decisions.md). Layers
        are matched by depth fraction. A draft of another width reads the same way through
        a RoutingMap (route_map.py) learned online from the server's own prefills; until it
        has enough samples the estimate below stands in."""
        if num_layers < 1 or not self.views:
            return False
        last = max(self.views)
        self.layer_map = {layer: round(layer * (num_layers - 1) / max(1, last))
                          for layer in self.views}
        self.routemap = None
        if hidden_size != self.embed.weight.shape[1]:
            from sglang.srt.expert_offload.routing.route_map import RoutingMap

            first = self.views[min(self.views)]
            self.routemap = RoutingMap(sorted(self.views), self.layer_map, hidden_size,
                                       first.gate.weight.shape[0])
        return True

    def _reads_draft(self) -> bool:
        """Predict from the draft's residuals (same width, or a map that has learned)."""
        return bool(self.layer_map) and (self.routemap is None or self.routemap.ready)

    def wants_catch_up(self) -> bool:
        return self.routemap is not None

    def on_draft_catch_up(self, rids, indices, hidden) -> bool:
        if self.routemap is None or not self.routemap.collecting:
            return False
        self.routemap.note_draft(rids, indices, hidden)
        return self.routemap.collecting

    def begin_step(self, ctx: StepContext) -> Dict[int, List[int]]:
        """Each request's last token (a tree's root) is the pass's first row: its experts can
        load during the whole of the draft's work. Under the calibrated cut, not when the
        draft's own residuals are coming (its first forward routes the roots): verify passes
        then read the draft, the estimate's rates are scored on prompt rows only, and a cut
        on a decode's roots from them would be blind (the estimate names ~half of them)."""
        self.drafted, self.latest, self.keep = {}, {}, {}
        if self.calibration is not None and self._reads_draft():
            return {}
        return self._route(ctx)

    def on_draft_level(self, ctx: StepContext) -> Dict[int, List[int]]:
        """The tokens drafted so far (each request's root and nodes), while the draft still
        computes its next levels: their loads overlap the draft's remaining forwards, where
        issued at before_verify they overlapped only the verify itself. With the draft's own
        residuals coming (on_draft_hidden), the estimate would only add over-fetch."""
        return {} if self._reads_draft() else self._route(ctx)

    def on_draft_hidden(self, rids, tokens, hidden) -> Dict[int, List[int]]:
        """Rows the draft just computed (roots, or a level's nodes): route each target layer
        from the matching draft layer's residual, and keep them for before_verify."""
        if not self.layer_map or not hidden:
            return {}
        layers = [layer for layer in sorted(self.views) if self.layer_map[layer] in hidden]
        if self.drafted and layers != self.hidden_layers:
            self.drafted, self.latest = {}, {}  # another cover: rows must stack alike
        self.hidden_layers = layers
        stack = torch.stack([hidden[self.layer_map[layer]] for layer in layers])  # [L, n, H]
        for row, (rid, token) in enumerate(zip(rids, tokens)):
            res = stack[:, row]
            self.drafted.setdefault(rid, {})[token] = res
            self.latest[rid] = (token, res)
        if not self._reads_draft():
            return {}
        own = torch.full((stack.shape[1],), OWN, dtype=torch.long)
        return self._rank_stacked(layers, stack, own, drafted=True)

    def _rank_stacked(self, layers: List[int], stack: torch.Tensor, sources: torch.Tensor,
                      drafted: bool = False, whole_pass: bool = False) -> Dict[int, List[int]]:
        """Route rows [L, n, H] of `layers` (`drafted`: the draft's rows; `sources` [n]: where
        each row's residual came from; `whole_pass`: the rows are the coming pass's, in its
        order); remember what to keep from eviction until each layer runs."""
        mapped = drafted and self.routemap is not None  # another width: mapped logits
        fetch, keep = (self._calibrated(layers, stack, sources, mapped, whole_pass)
                       if self.calibration is not None else self._fixed(layers, stack, mapped))
        for layer, masses in keep.items():
            # hooks route growing sets of the pass's rows (roots, levels, all): the largest
            # mass seen is the one of the most rows
            kept = self.keep.setdefault(layer, {})
            for e, m in masses.items():
                kept[e] = max(m, kept.get(e, m))
        return fetch

    def _calibrated(self, layers: List[int], stack: torch.Tensor, sources: torch.Tensor,
                    mapped: bool, whole_pass: bool) -> tuple:
        """fetch / keep by calibrated pass probabilities (routing/calibration.py); layers the
        calibration does not cover (another expert count) by the fixed rule."""
        cal = self.calibration
        if mapped:
            scores = self._mapped_scores(layers, stack)
            pick = [i for i, x in enumerate(layers) if x in cal.index]
            covered = [layers[i] for i in pick]
            scores = scores[pick] if len(pick) != len(layers) else scores
        else:
            covered, scores = self.routers.stacked_scores(layers, stack)
        fetch, keep = (select(covered, cal.pass_evidence(covered, scores, sources),
                              self.min_prob) if covered else ({}, {}))
        if whole_pass and covered:
            self._pass, self._routed = (covered, scores, sources), {}
        rest = [x for x in layers if x not in cal.index]
        if rest:
            more = self._fixed(rest, stack[[layers.index(x) for x in rest]], mapped)
            fetch.update(more[0])
            keep.update(more[1])
        return fetch, keep

    def _fixed(self, layers: List[int], stack: torch.Tensor, mapped: bool) -> tuple:
        """fetch / keep by the fixed rule: every row's top-(k + width), keep_width more kept."""
        if mapped:
            scores = self._mapped_scores(layers, stack)
            return self.routers.rank_scores(layers, scores, self.width, self.keep_width)
        return self.routers.rank_stacked(layers, stack, self.width, self.keep_width)

    def _mapped_scores(self, layers: List[int], stack: torch.Tensor) -> torch.Tensor:
        """Router scores [L, n, E] the RoutingMap predicts from draft rows [L, n, H_draft]
        (`layers`: a subset of the map's, in its order)."""
        return self.routers.scores_of(layers, self.routemap.logits(stack, layers))

    def keep_for(self, layer: int) -> Set[int]:
        return set(self.keep.get(layer, ()))

    def scores_for(self, layer: int) -> Dict[int, float]:
        return self.keep.get(layer, {})

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.keep.pop(layer, None)  # the pass has used the layer: its next use is next step
        if self._pass is not None and layer in self._pass[0]:
            layers, scores, _ = self._pass
            if topk_ids.shape[0] == scores.shape[1]:  # the pass predicted (else another)
                self._routed[layer] = topk_ids
            if len(self._routed) == len(layers):
                self._score_pass()

    def _score_pass(self) -> None:
        """Score the prediction for the pass on the layers that have run, then drop it."""
        if self._pass is not None and self._routed:
            layers, scores, sources = self._pass
            pick = [i for i, x in enumerate(layers) if x in self._routed]
            self.calibration.observe_layers(
                [layers[i] for i in pick], scores[pick], sources,
                torch.stack([self._routed[layers[i]] for i in pick]))
        self._pass, self._routed = None, {}

    def before_verify(self, ctx: StepContext) -> Dict[int, List[int]]:
        if len(self.state) > 2 * len(ctx.rids) + 64:  # aborted requests never say goodbye
            live = set(ctx.rids)
            self.state = {rid: s for rid, s in self.state.items() if rid in live}
        self._score_pass()  # a pass that ran fewer layers (none: nothing to score)
        out = self._route_drafted(ctx) if self.drafted and self._reads_draft() else \
            self._route(ctx, whole_pass=True)
        self._log_target_rows(ctx)
        rows, row = [], 0
        for rid, toks, tree in zip(ctx.rids, ctx.tokens, ctx.is_tree):
            keep = row if tree else row + len(toks) - 1  # a tree's root is always kept
            rows.append((rid, keep, toks[keep - row]))
            row += len(toks)
        # The pass about to run replaces each request's state, layer by layer.
        self._rows, self._num_rows = [], row
        for rid, keep, token in rows:
            self.state[rid] = (token, {})
            self._rows.append((rid, keep))
        return out

    def _route(self, ctx: StepContext, whole_pass: bool = False) -> Dict[int, List[int]]:
        """Experts per layer for the context's tokens (read-only)."""
        layers, x, sources = self._estimated_rows(ctx)
        return self._rank_stacked(layers, x, sources, whole_pass=whole_pass) \
            if x is not None else {}

    def _route_drafted(self, ctx: StepContext) -> Dict[int, List[int]]:
        layers, x, sources = self._drafted_rows(ctx)
        return self._rank_stacked(layers, x, sources, drafted=True, whole_pass=True) \
            if x is not None else {}

    def row_experts(self, ctx: StepContext) -> Optional[tuple]:
        """(layers, [L, rows, E] bool): the experts each row of the pass is predicted to be
        routed to (its top-k), from the draft's residuals where it has them, else the
        estimate. What budget-aware trees price (expert_offload/tree_budget.py)."""
        drafted = bool(self.drafted) and self._reads_draft()
        layers, x, _ = self._drafted_rows(ctx) if drafted else self._estimated_rows(ctx)
        if x is None or not layers:
            return None
        if drafted and self.routemap is not None:
            return layers, self.routers.chosen_scores(layers, self._mapped_scores(layers, x))
        return layers, self.routers.chosen(layers, x)

    def _estimated_rows(self, ctx: StepContext) -> tuple:
        """(layers, rows [L, n, H], sources [n]): each row's residual estimated from the
        request's latest processed token (see the class docstring); None rows for an empty
        context."""
        layers = sorted(self.views)
        embs, bases = [], {layer: [] for layer in layers}
        with torch.no_grad():
            for rid, toks in zip(ctx.rids, ctx.tokens):
                emb = self.embed.weight[torch.tensor(toks)]
                embs.append(emb)
                prev = self.state.get(rid)
                for layer in layers:
                    if prev is None or layer not in prev[1]:
                        bases[layer].append(torch.zeros_like(emb))
                    else:
                        token, res = prev
                        base = res[layer] - self.embed.weight[token].to(res[layer].dtype)
                        bases[layer].append(base.to(emb.dtype).expand_as(emb))
            if not embs:
                return layers, None, None
            emb = torch.cat(embs)
            sources = torch.full((emb.shape[0],), ESTIMATE, dtype=torch.long)
            return layers, torch.stack([emb + torch.cat(bases[layer]) for layer in layers]), \
                sources

    def _drafted_rows(self, ctx: StepContext) -> tuple:
        """(layers, rows [L, n, H], sources [n]) of the pass from the draft's residuals: a
        token the draft computed as it is, one it did not (the last level) from the request's
        latest draft residual with the embeddings swapped (the estimate of _estimated_rows,
        one token back instead of a step)."""
        layers = self.hidden_layers
        emb = self.embed.weight
        rows: List[torch.Tensor] = []  # each [L, H]
        sources: List[int] = []
        with torch.no_grad():
            dtype = next(iter(self.latest.values()))[1].dtype
            for rid, toks in zip(ctx.rids, ctx.tokens):
                seen = self.drafted.get(rid, {})
                latest = self.latest.get(rid)
                for tok in toks:
                    res = seen.get(tok)
                    if res is not None:
                        rows.append(res)
                        sources.append(OWN)
                    elif latest is not None and self.routemap is not None:
                        rows.append(latest[1])  # another width: one token back, as it is
                        sources.append(BACK)
                    elif latest is not None:  # one token back, embeddings swapped
                        rows.append(latest[1] - emb[latest[0]].to(dtype) + emb[tok].to(dtype))
                        sources.append(BACK)
                    else:  # nothing drafted for this request: the embedding alone
                        rows.append(emb[tok].to(dtype).expand(len(layers), -1))
                        sources.append(ESTIMATE)
            if not rows:
                return layers, None, None
            return layers, torch.stack(rows, dim=1), torch.tensor(sources, dtype=torch.long)

    def _log_target_rows(self, ctx: StepContext) -> None:
        """RoutingMap samples: the rows of this pass that are prompt or plain decode tokens
        (at most the map's per-request cap each; paired when the draft catches up), then the
        draft tokens of a verify whose residuals the draft computed (paired at once)."""
        rm = self.routemap
        self._map_rows = None
        if rm is None or not rm.collecting or ctx.starts is None:
            return
        entries, index, row = [], [], 0
        for rid, toks, tree, start in zip(ctx.rids, ctx.tokens, ctx.is_tree, ctx.starts):
            n = 0 if tree else min(len(toks), max(0, rm.max_rows - start))
            if n:
                entries.append((rid, start, n))
                index.extend(range(row, row + n))
            row += len(toks)
        own, drafted = self._own_rows(ctx)
        index.extend(own)
        if index:
            self._map_rows = (torch.tensor(index), row)
        rm.begin_pass(entries, drafted)

    def _own_rows(self, ctx: StepContext) -> tuple:
        """(pass rows, {draft layer: residuals [m, H]}) of the draft tokens this step's draft
        computed itself. A token id met twice in one request's rows is left out: `drafted`
        holds one residual per token id, which may be the other occurrence's."""
        by_draft: Dict[int, int] = {}  # draft layer -> its row in the stacks of hidden_layers
        for j, layer in enumerate(self.hidden_layers):
            by_draft.setdefault(self.layer_map[layer], j)
        if not self.drafted or any(d not in by_draft for d in self.routemap.draft_layers):
            return [], None
        rows, res, row = [], [], 0
        for rid, toks, tree in zip(ctx.rids, ctx.tokens, ctx.is_tree):
            seen = self.drafted.get(rid) if tree else None
            counts = collections.Counter(toks) if seen else None
            for i, tok in enumerate(toks):
                if seen and tok in seen and counts[tok] == 1:
                    rows.append(row + i)
                    res.append(seen[tok])
            row += len(toks)
        if not rows:
            return [], None
        stack = torch.stack(res, dim=1)  # [L, m, H]
        return rows, {d: stack[j] for d, j in by_draft.items()}

    def on_moe_input(self, layer, normed, residual, ctx) -> Dict[int, List[int]]:
        if self._map_rows is not None and layer in self.views:
            index, total = self._map_rows
            if normed.shape[0] == total:
                with torch.no_grad():
                    rows = normed.index_select(0, index.to(normed.device))
                    logits = torch.nn.functional.linear(
                        rows, self.views[layer].gate.weight.to(rows.dtype))
                self.routemap.note_logits(layer, logits)
        if self._rows and layer in self.views and residual.shape[0] == self._num_rows:
            for rid, row in self._rows:
                self.state[rid][1][layer] = residual[row].detach().clone()
        return {}

    def figures(self) -> dict:
        return {"calibration": self.calibration.to_dict()} if self.calibration else {}

    def forget(self, rid: str) -> None:
        self.state.pop(rid, None)
        self.drafted.pop(rid, None)
        self.latest.pop(rid, None)
        if self.routemap is not None:
            self.routemap.forget(rid)


def build(views, embed, width: int, num_slots: int, keep_width: int,
          min_prob: float) -> DraftPredictor:
    return DraftPredictor(views, embed, width, keep_width, min_prob)
