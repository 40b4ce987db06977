"""STANDALONE drafter: a small model with the target's tokenizer and its own KV pool.

Per step and request: catch the draft's KV up to the request's last token (the root),
then grow a tree for `num_steps` levels: each level forwards the frontier (the `topk`
best nodes of the previous level) over the draft prefix plus the frontier's ancestors
(a tree mask over a KV index list, no copies) and offers each frontier node's `topk` best
children. The best `budget` nodes by cumulative draft log-probability form the tree.
Tree nodes' draft KV is temporary: freed at the end of propose; accepted tokens are
re-read by the next catch-up (a few tokens, in the same forward as the bonus token).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.drafters.base import Drafter
from sglang.srt.speculative.tree import DraftTree, select_best

logger = logging.getLogger(__name__)


class StandaloneDrafter(Drafter):
    def __init__(self, server_args, max_running: int, context_len: int, max_total_tokens: int,
                 num_steps: int, topk: int, chunk_size: int) -> None:
        self.num_steps = num_steps
        self.topk = topk
        self.chunk_size = chunk_size
        extra = max_running * (topk * max(num_steps, 1) + 2)
        self.runner = ModelRunner(server_args, model_path=server_args.speculative_draft_model_path,
                                  max_context_len=context_len,
                                  max_total_tokens=max_total_tokens + extra)
        self.allocator = self.runner.allocator
        self.req_to_token = ReqToTokenPool(max_running, context_len + 8)
        self.kv_len: Dict[str, int] = {}  # rid -> tokens of fill_ids with draft KV

    # ------------------------------------------------------------------ propose
    def propose(self, reqs, budgets, depth=None) -> List[Optional[DraftTree]]:
        steps = self.num_steps if depth is None else max(1, min(depth, self.num_steps))
        live, reserved = [], 0
        for r in reqs:
            self._rewind(r)
            need = r.fill_len - self.kv_len.get(r.rid, 0) + self.topk * self.num_steps + 1
            # Short of draft slots: this request decodes plainly this step.
            if reserved + need <= self.allocator.available_size():
                reserved += need
                live.append(r)
        root_logits = self._catch_up(live)
        trees = self._grow(live, root_logits, [budgets[reqs.index(r)] for r in live], steps)
        out: Dict[int, DraftTree] = {id(r): t for r, t in zip(live, trees)}
        return [out.get(id(r)) for r in reqs]

    def _rewind(self, req) -> None:
        """Keep draft KV strictly before the root, so catch-up always yields root logits."""
        have = self.kv_len.get(req.rid, 0)
        if have > req.fill_len - 1:
            row = self.req_to_token.req_to_token[req.req_pool_idx]
            self.allocator.free(row[req.fill_len - 1 : have].clone())
            self.kv_len[req.rid] = req.fill_len - 1

    def _catch_up(self, reqs) -> List[torch.Tensor]:
        """Draft-extend every request to its last token; returns root logits per request."""
        logits: List[Optional[torch.Tensor]] = [None] * len(reqs)
        while True:
            todo = [(i, r) for i, r in enumerate(reqs) if logits[i] is None]
            if not todo:
                return logits  # type: ignore[return-value]
            budget = max(self.chunk_size, 1)
            batch, chunks, wants = [], [], []
            for i, r in todo:
                start = self.kv_len.get(r.rid, 0)
                n = r.fill_len - start
                take = n if n <= max(budget, 1) else max(budget, 0)
                if take == 0:
                    continue
                budget -= take
                batch.append((i, r))
                chunks.append(r.fill_ids[start : start + take])
                wants.append(take == n)
            out = self._extend([r for _, r in batch], chunks, wants)
            k = 0
            for (i, r), want in zip(batch, wants):
                if want:
                    logits[i] = out[k]
                    k += 1

    def _extend(self, reqs, chunks: List[List[int]], wants: List[bool]) -> torch.Tensor:
        ids, pos, rows, seq_lens, locs = [], [], [], [], []
        for r, chunk, want in zip(reqs, chunks, wants):
            start = self.kv_len.get(r.rid, 0)
            row = r.req_pool_idx
            slots = self.allocator.alloc(len(chunk))
            self.req_to_token.write(row, start, slots)
            locs.append(slots)
            ids += chunk
            pos += range(start, start + len(chunk))
            if want:
                rows.append(len(ids) - 1)
            seq_lens.append(start + len(chunk))
            self.kv_len[r.rid] = start + len(chunk)
        fb = self._batch(ForwardMode.DRAFT_EXTEND, reqs, ids, pos, seq_lens,
                         [len(c) for c in chunks], torch.cat(locs), rows)
        return self.runner.forward(fb)

    def _grow(self, reqs, root_logits: List[torch.Tensor], budgets: List[int],
              steps: int) -> List[DraftTree]:
        trees = [DraftTree.root_only(r.fill_ids[-1]) for r in reqs]
        frontier: List[List[int]] = [[0] for _ in reqs]
        logits = [x.unsqueeze(0) for x in root_logits]  # per request: [len(frontier), vocab]
        node_slots: List[Dict[int, int]] = [{} for _ in reqs]  # tree node -> draft slot
        temp_slots: List[torch.Tensor] = []
        for step in range(steps):
            for i, tree in enumerate(trees):
                children = []
                lps = torch.log_softmax(logits[i].float(), dim=-1)
                top = torch.topk(lps, self.topk, dim=-1)
                for f, node in enumerate(frontier[i]):
                    for lp, tok in zip(top.values[f].tolist(), top.indices[f].tolist()):
                        children.append(tree.add(tok, node, tree.scores[node] + lp))
                # The next level expands only the best `topk` new nodes (EAGLE-2 beam).
                children.sort(key=lambda c: -tree.scores[c])
                frontier[i] = children[: self.topk]
            if step == steps - 1:
                break
            logits = self._forward_frontier(reqs, trees, frontier, node_slots, temp_slots)
        for slots in temp_slots:
            self.allocator.free(slots)
        return [select_best(t, b) for t, b in zip(trees, budgets)]

    def _forward_frontier(self, reqs, trees, frontier, node_slots, temp_slots):
        ids, pos, seq_lens, ext, kv_idx, masks = [], [], [], [], [], []
        new_slots = self.allocator.alloc(sum(len(f) for f in frontier))
        temp_slots.append(new_slots)
        k = 0
        for r, tree, front, slots_of in zip(reqs, trees, frontier, node_slots):
            prefix_len = self.kv_len[r.rid]
            prefix = self.req_to_token.req_to_token[r.req_pool_idx, :prefix_len]
            for node in front:
                slots_of[node] = int(new_slots[k])
                k += 1
            nodes = sorted(slots_of)  # every tree node with draft KV, frontier included
            col = {n: j for j, n in enumerate(nodes)}
            tree_mask = torch.zeros((len(front), len(nodes)), dtype=torch.bool)
            for q, node in enumerate(front):
                for a in tree.path_to(node)[1:]:  # the root's KV is in the prefix
                    tree_mask[q, col[a]] = True
            masks.append(torch.cat([torch.ones((len(front), prefix_len), dtype=torch.bool),
                                    tree_mask], 1))
            kv_idx.append(torch.cat([prefix, torch.tensor([slots_of[n] for n in nodes])]))
            ids += [tree.tokens[n] for n in front]
            pos += [prefix_len - 1 + tree.depths[n] for n in front]
            seq_lens.append(prefix_len + len(nodes))
            ext.append(len(front))
        fb = self._batch(ForwardMode.DRAFT_EXTEND, reqs, ids, pos, seq_lens, ext, new_slots,
                         list(range(len(ids))), kv_indices=kv_idx, custom_mask=masks)
        out = self.runner.forward(fb)
        split, start = [], 0
        for e in ext:
            split.append(out[start : start + e])
            start += e
        return split

    def _batch(self, mode, reqs, ids, pos, seq_lens, ext, out_loc, rows, kv_indices=None,
               custom_mask=None) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=mode, batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens), extend_seq_lens=torch.tensor(ext),
            out_cache_loc=out_loc, req_to_token_pool=self.req_to_token,
            token_to_kv_pool=self.runner.kv_pool, attn_backend=self.runner.attn_backend,
            seq_lens_cpu=list(seq_lens), extend_seq_lens_cpu=list(ext),
            logits_indices=torch.tensor(rows, dtype=torch.int64),
            kv_indices=kv_indices, custom_mask=custom_mask)

    # ------------------------------------------------------------------ memory
    def release(self, req) -> None:
        n = self.kv_len.pop(req.rid, 0)
        if n and req.req_pool_idx is not None:
            self.allocator.free(self.req_to_token.req_to_token[req.req_pool_idx, :n].clone())

    def check_all_free(self) -> None:
        assert not self.kv_len, f"draft KV still held for {list(self.kv_len)}"
        assert self.allocator.available_size() == self.allocator.size, "draft KV slots leaked"
