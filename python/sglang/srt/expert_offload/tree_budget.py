"""Budget-aware trees (`--moe-prefetch-prune-tree`): drop the branches of a step's draft trees
whose experts cost the verify pass more time than the branch is worth in expected tokens.

Verifying a tree on an MoE target routes every node's row. A node whose experts no other row
of the pass needs, and that are neither resident nor already loading, adds their loads to the
pass; with a fast tier that holds few experts the deepest, least likely nodes of a tree bring
in much of the union (a few tokens touch several times the experts of one: docs/decisions.md).

The rule. A step emits E = sum over requests of (1 + sum of P(node accepted)) tokens in T
seconds. Dropping a branch S (a node and everything below it) gives up p_S = sum of P(u) over
S and saves c_S = (loads that only S needs) x (seconds one missed expert costs the pass).
Tokens per second rise iff p_S / E < c_S / T. The branch with the highest c_S / p_S that
passes goes first, and every branch is priced again after a drop (its own loads may now be
the only ones left for some expert).

P(u) = P(parent) x rate x share(u): `rate` is the request's per-position acceptance (its
controller's moving average), split between siblings by the draft's own probabilities.
Which experts a row needs is the prefetch predictor's routing of the draft's residuals
(DraftPredictor.row_experts): a guess, so a prune can cost a token it need not have; never
correctness, since verification is exact on any tree.

Prices come from the running server: seconds per missed expert from the store's stall time
over its misses, T from recent decode steps of the same batch size. Until both are measured
nothing is pruned.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from sglang.srt.speculative.tree import DraftTree  # the trees it prices, by duck type
from sglang.srt.utils.stats import ema


def node_probs(tree: DraftTree, rate: float) -> List[float]:
    """P(node accepted) for every node (the root: 1), as the module docstring defines it."""
    probs = [1.0] * len(tree)
    kids = tree.children()
    for parent in range(len(tree)):
        group = kids[parent]
        if not group:
            continue
        scores = [tree.scores[i] for i in group]
        if all(math.isfinite(x) for x in scores):
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
        else:
            weights = [1.0] * len(group)
        total = sum(weights)
        for i, w in zip(group, weights):
            probs[i] = probs[parent] * rate * w / total
    return probs


@dataclasses.dataclass
class PruneResult:
    trees: List[Optional[DraftTree]]
    kept: List[Optional[List[int]]]  # per tree: the original node ids it keeps
    nodes_removed: int = 0
    loads_saved: int = 0  # predicted expert loads the pass no longer makes
    tokens_given_up: float = 0.0  # expected tokens of the dropped branches


def prune_trees(trees: Sequence[Optional[DraftTree]], probs: Sequence[Optional[List[float]]],
                rows: Sequence[Optional[torch.Tensor]], fixed: torch.Tensor, load_s: float,
                step_s: float) -> PruneResult:
    """trees[i]: request i's tree (None: the request decodes plainly and emits one token).
    probs[i]: node_probs of trees[i]. rows[i]: [len(trees[i]), L, E] bool, the experts each
    node is predicted to need. fixed: [L, E] bool, experts that cost no load this pass
    (resident or loading, or needed by rows that always run: plain requests, prompt chunks)."""
    keep = [None if t is None else [True] * len(t) for t in trees]
    count = torch.zeros(fixed.shape, dtype=torch.int32)
    expected = 0.0
    for t, r, p in zip(trees, rows, probs):
        if t is None:
            expected += 1.0
            continue
        count += r.sum(0, dtype=torch.int32)
        expected += sum(p)
    free = fixed.clone()
    result = PruneResult(list(trees), [None if t is None else list(range(len(t)))
                                       for t in trees])
    step = step_s
    while True:
        best: Optional[Tuple[float, int, List[int], torch.Tensor, int, float]] = None
        for i, t in enumerate(trees):
            if t is None:
                continue
            for node in range(1, len(t)):
                if not keep[i][node]:
                    continue
                branch = [u for u in t.subtree(node) if keep[i][u]]
                need = rows[i][branch].sum(0, dtype=torch.int32)
                only = (need > 0) & (count == need) & ~free
                loads = int(only.sum())
                gain = sum(probs[i][u] for u in branch)
                if not loads or gain * step >= loads * load_s * expected:
                    continue
                ratio = loads / max(gain, 1e-9)
                if best is None or ratio > best[0]:
                    best = (ratio, i, branch, need, loads, gain)
        if best is None:
            break
        _, i, branch, need, loads, gain = best
        for u in branch:
            keep[i][u] = False
        count -= need
        expected -= gain
        step = max(step - loads * load_s, 1e-6)
        result.nodes_removed += len(branch)
        result.loads_saved += loads
        result.tokens_given_up += gain
    for i, t in enumerate(trees):
        if t is not None and not all(keep[i]):
            result.kept[i] = [u for u, k in enumerate(keep[i]) if k]
            result.trees[i] = t.subset(result.kept[i])
    return result


class TreeBudget:
    """The prices prune_trees needs, measured on the running server, and its figures."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.load_s: Optional[float] = None  # seconds the pass loses per missed expert
        self.step_s: Dict[int, float] = {}  # batch size -> decayed decode step seconds
        self._seen = (0.0, 0)  # the store's (stall seconds, misses) at the last look
        self._waited = False  # load_s measured from waits (else a load's own time)
        self.steps = 0  # steps priced
        self.steps_pruned = 0
        self.nodes_removed = 0
        self.loads_saved = 0
        self.tokens_given_up = 0.0

    def observe_store(self, stall_seconds: float, misses: int, sample: bool = True,
                      loads: int = 0, load_seconds: float = 0.0) -> None:
        """The store's running totals after a step (a reset of its stats starts over);
        `misses`: the loads a layer waited for (demand misses and late prefetches).
        `sample` False (a step with a prompt chunk): only note the totals; a prefill's
        loads overlap its long compute and would price a decode's misses too low.
        Until a decode step has waited for a load, a miss is priced at a load's own time
        (`load_seconds / loads`): whether prefetches happened to finish in time must not
        decide whether trees are priced at all."""
        stall0, miss0 = self._seen
        if misses < miss0 or stall_seconds < stall0:
            stall0, miss0 = 0.0, 0
        if sample and misses > miss0:
            self.load_s = ema(self.load_s if self._waited else None,
                              (stall_seconds - stall0) / (misses - miss0), self.decay)
            self._waited = True
        elif not self._waited and loads > 0:
            self.load_s = load_seconds / loads
        self._seen = (stall_seconds, misses)

    def observe_step(self, batch_size: int, seconds: float) -> None:
        """A pure decode step of `batch_size` requests took `seconds`."""
        self.step_s[batch_size] = ema(self.step_s.get(batch_size), seconds, self.decay)

    def prune(self, trees: Sequence[Optional[DraftTree]], rates: Sequence[float],
              rows: Sequence[Optional[torch.Tensor]], fixed: torch.Tensor
              ) -> List[Optional[DraftTree]]:
        step = self.step_s.get(len(trees))
        if self.load_s is None or step is None or not any(t is not None for t in trees):
            return list(trees)
        probs = [None if t is None else node_probs(t, rate) for t, rate in zip(trees, rates)]
        result = prune_trees(trees, probs, rows, fixed, self.load_s, step)
        self.steps += 1
        if result.nodes_removed:
            self.steps_pruned += 1
            self.nodes_removed += result.nodes_removed
            self.loads_saved += result.loads_saved
            self.tokens_given_up += result.tokens_given_up
        return result.trees

    def to_dict(self) -> dict:
        return {"steps": self.steps, "steps_pruned": self.steps_pruned,
                "nodes_removed": self.nodes_removed, "loads_saved": self.loads_saved,
                "tokens_given_up": round(self.tokens_given_up, 3),
                "load_seconds": self.load_s}
