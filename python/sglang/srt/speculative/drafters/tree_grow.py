"""How a draft model grows a request's tree, level by level (a mixin of StandaloneDrafter and
the head drafters built on it): each level forwards the frontier (the `topk` best new nodes)
over the draft's view plus the frontier's ancestors under a tree mask, and offers each
frontier node's `topk` best children; the best `budget` nodes by cumulative log-probability
form the tree. Every request's top-k of a level comes to the host in one read, its new slots
in another (utils/host_sync.py). Tree nodes' draft KV is freed at the end.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang.srt.speculative.tree import DraftTree, select_best
from sglang.srt.utils import host_sync


class TreeGrowMixin:
    def _grow(self, reqs, root_logits: List[torch.Tensor], budgets: List[int],
              steps: int) -> List[DraftTree]:
        if not reqs:
            return []
        trees = [DraftTree.root_only(r.fill_ids[-1]) for r in reqs]
        frontier: List[List[int]] = [[0] for _ in reqs]
        logits = [x.unsqueeze(0) for x in root_logits]  # per request: [len(frontier), vocab]
        node_slots: List[Dict[int, int]] = [{} for _ in reqs]  # tree node -> draft slot
        temp_slots: List[torch.Tensor] = []
        for step in range(steps):
            # every request's top-k of this level in one read from the device
            tops = [torch.topk(torch.log_softmax(x.float(), dim=-1), self.topk, dim=-1)
                    for x in logits]
            vals = host_sync.to_list(torch.cat([t.values for t in tops]), "draft_topk")
            ids = host_sync.to_list(self._target_ids(torch.cat([t.indices for t in tops])),
                                    "draft_topk")
            row = 0
            for i, tree in enumerate(trees):
                children = []
                for node in frontier[i]:
                    for lp, tok in zip(vals[row], ids[row]):
                        children.append(tree.add(tok, node, tree.scores[node] + lp))
                    row += 1
                # The next level expands only the best `topk` new nodes (EAGLE-2 beam).
                children.sort(key=lambda c: -tree.scores[c])
                frontier[i] = children[: self.topk]
            if step == steps - 1:
                break
            self.observer.on_level(reqs, trees)  # expert loads overlap the next levels
            logits = self._forward_frontier(reqs, trees, frontier, node_slots, temp_slots)
        for slots in temp_slots:
            self.allocator.free(slots)
        return [select_best(t, b) for t, b in zip(trees, budgets)]

    def _forward_frontier(self, reqs, trees, frontier, node_slots, temp_slots):
        ids, pos, seq_lens, ext, kv_idx, masks, tails = [], [], [], [], [], [], []
        new_slots = self.allocator.alloc(sum(len(f) for f in frontier))
        temp_slots.append(new_slots)
        new_host = host_sync.to_list(new_slots, "draft_slots")
        k = 0
        for r, tree, front, slots_of in zip(reqs, trees, frontier, node_slots):
            ctx = self.contexts[r.rid]
            prefix = self.kv.view(ctx)  # the root's KV is its last computed token
            root_pos = self.kv.root_position(ctx)
            for node in front:
                slots_of[node] = new_host[k]
                k += 1
            nodes = sorted(slots_of)  # every tree node with draft KV, frontier included
            col = {n: j for j, n in enumerate(nodes)}
            tree_mask = torch.zeros((len(front), len(nodes)), dtype=torch.bool)
            for q, node in enumerate(front):
                for a in tree.path_to(node)[1:]:  # the root's KV is in the prefix
                    tree_mask[q, col[a]] = True
            masks.append(torch.cat([torch.ones((len(front), len(prefix)), dtype=torch.bool),
                                    tree_mask], 1))
            tails.append(len(nodes))  # the view's prefix is seen whole
            kv_idx.append(torch.cat([prefix, torch.tensor([slots_of[n] for n in nodes],
                                                     device=prefix.device)]))
            ids += [tree.tokens[n] for n in front]
            pos += [root_pos + tree.depths[n] for n in front]
            seq_lens.append(len(prefix) + len(nodes))
            ext.append(len(front))
        fb = self._batch(reqs, ids, torch.tensor(pos, dtype=torch.int64), seq_lens, ext,
                         new_slots, list(range(len(ids))), kv_indices=kv_idx, custom_mask=masks,
                         custom_mask_tails=tails)
        rids = [r.rid for r, front in zip(reqs, frontier) for _ in front]
        nodes = [(tree, node) for tree, front in zip(trees, frontier) for node in front]
        out = self._forward_telling(fb, rids, ids, list(range(len(ids))), nodes=nodes)
        split, start = [], 0
        for e in ext:
            split.append(out[start : start + e])
            start += e
        return split
