"""Tree verification: which drafted path the target accepts.

Greedy: follow the child whose token is the target's argmax; the first node without such a
child contributes the argmax itself (the bonus token).
Sampling: at each node the siblings are tried in order as point-mass proposals: a child with
token x is accepted with probability r(x) under the residual r (initially the target's
processed distribution p); a rejection zeroes r(x) and renormalises. If every child is
rejected a token is drawn from r (recovered); past an accepted leaf, from p (bonus). This
outputs exactly p at every position, whatever the drafter proposed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Union

import torch

from sglang.srt.sampling.sampler import draw_from_probs
from sglang.srt.speculative.tree import DraftTree


@dataclasses.dataclass
class VerifyResult:
    path: List[int]  # accepted node indices, starting at the root
    tokens: List[int]  # accepted drafted tokens + the bonus / recovered token

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


TargetAt = Union[Sequence[int], Callable[[int], int]]
ProbsAt = Union[torch.Tensor, Callable[[int], torch.Tensor]]


def verify_greedy(tree: DraftTree, target_ids: TargetAt) -> VerifyResult:
    """target_ids[i] (or target_ids(i)): argmax of the target's adjusted logits at node i.
    A callable is asked only for accepted nodes, root first, in path order (so a grammar
    matcher can advance along the path as it is walked)."""
    target = target_ids if callable(target_ids) else target_ids.__getitem__
    kids = tree.children()
    node, path = 0, [0]
    while True:
        want = target(node)
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [want])
        node = nxt
        path.append(node)


def _uniform(generator: Optional[torch.Generator]) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    return int(draw_from_probs(probs.unsqueeze(0), [generator])[0])


def verify_sampling(tree: DraftTree, probs: ProbsAt,
                    generator: Optional[torch.Generator]) -> VerifyResult:
    """probs: [n, vocab] the target's processed distribution at every node (or a callable
    giving node i's row, asked in path order as in verify_greedy)."""
    probs_at = probs if callable(probs) else probs.__getitem__
    kids = tree.children()
    node, path = 0, [0]
    while True:
        p_node = probs_at(node)
        residual = p_node.double().clone()
        mass = float(residual.sum())
        accepted = None
        for child in kids[node]:
            x = tree.tokens[child]
            if mass <= 0:
                break
            if _uniform(generator) * mass < float(residual[x]):
                accepted = child
                break
            mass -= float(residual[x])
            residual[x] = 0.0
        if accepted is None:
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [_draw(residual, generator)])
        node = accepted
        path.append(node)
        if not kids[node]:
            return VerifyResult(path, [tree.tokens[i] for i in path[1:]]
                                + [_draw(probs_at(node), generator)])
