"""DraftTree: the tokens a drafter proposes for one request, and the tree attention mask.

Node 0 is the root: the request's last token, whose KV the verify pass computes. Every
other node is a drafted token; `parents[i] < i` always (nodes are in topological order),
so a path is read by following parents to 0.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch


@dataclasses.dataclass
class DraftTree:
    tokens: List[int]  # [n]
    parents: List[int]  # [n], -1 for the root
    depths: List[int]  # [n], 0 for the root
    scores: List[float]  # [n] cumulative draft log-probability (root 0.0)

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls([token], [-1], [0], [0.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.tokens) - 1

    def children(self) -> List[List[int]]:
        kids: List[List[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        # Best-scored child first: the verifier tries siblings in this order.
        for k in kids:
            k.sort(key=lambda i: -self.scores[i])
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: row i is True at i and at every ancestor of i."""
        n = len(self.tokens)
        mask = torch.zeros((n, n), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """[n, prefix_len + n] bool: every node sees the whole prefix and its ancestors."""
        n = len(self.tokens)
        return torch.cat([torch.ones((n, prefix_len), dtype=torch.bool), self.ancestor_mask()], 1)

    def subtree(self, node: int) -> List[int]:
        """`node` and every node below it (parents precede children, so one pass finds them)."""
        inside = [False] * len(self.tokens)
        inside[node] = True
        for i in range(node + 1, len(self.tokens)):
            inside[i] = self.parents[i] >= 0 and inside[self.parents[i]]
        return [i for i, x in enumerate(inside) if x]

    def subset(self, keep) -> "DraftTree":
        """The tree of the nodes in `keep` (closed under ancestors, the root among them),
        renumbered in their order."""
        kept = sorted(keep)
        new_index = {old: new for new, old in enumerate(kept)}
        return DraftTree(
            tokens=[self.tokens[i] for i in kept],
            parents=[-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in kept],
            depths=[self.depths[i] for i in kept],
            scores=[self.scores[i] for i in kept],
        )

    def path_to(self, node: int) -> List[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def select_best(candidates: DraftTree, budget: int) -> DraftTree:
    """Keep the root and the `budget - 1` best nodes by cumulative score (EAGLE-2).

    Scores never increase along a path, so the best nodes are closed under ancestors when
    ties are broken toward shallower nodes; we also add any missing ancestor to be safe.
    """
    n = len(candidates)
    if n <= budget:
        return candidates
    order = sorted(range(1, n), key=lambda i: (-candidates.scores[i], candidates.depths[i], i))
    keep = {0}
    for i in order:
        if len(keep) >= budget:
            break
        chain = [j for j in candidates.path_to(i) if j not in keep]
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    return candidates.subset(keep)  # parents precede children in the candidate order
