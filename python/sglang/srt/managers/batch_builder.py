"""Turn a step plan into the ForwardBatch the target runs."""

from __future__ import annotations

from typing import Tuple

import torch

from sglang.srt.managers.step_plan import StepPlan
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode


def build_forward_batch(plan: StepPlan, req_to_token_pool, runner,
                        outputs) -> Tuple[ForwardBatch, list]:
    """The forward of a plan: each request's rows (a tree's nodes at their depths, under
    the tree mask), its KV slots, and the rows whose logits the step needs (per request).
    Every tensor is made on the runner's device, here and nowhere later in the step; the
    req_to_token table lives there too, so the slots are sliced out in place."""
    dev = runner.device
    ids, pos, rows, logit_rows, masks, tails = [], [], [], [], [], []
    start = 0
    for it in plan.items:
        req, n, tree = it.req, it.num_tokens, it.tree
        ids.extend(it.tokens())
        if tree is not None:
            # Verify: the whole tree, each node at its depth, under the tree mask.
            pos.extend(req.kv_len + d for d in tree.depths)
            masks.append(tree.attention_mask(req.kv_len).to(dev))
            tails.append(n)  # the prefix is seen whole
            rows.append(list(range(start, start + n)))
            logit_rows.extend(rows[-1])
        else:
            pos.extend(range(req.kv_len, req.kv_len + n))
            masks.append(None)
            tails.append(0)
            rows.append(outputs.logit_rows(req, req.kv_len, n, start))
            logit_rows.extend(rows[-1].all_rows())
        start += n
    table = req_to_token_pool.req_to_token
    nums = [it.num_tokens for it in plan.items]
    pool_rows = [r.req_pool_idx for r in plan.reqs]
    seq_lens = [r.kv_len + n for r, n in zip(plan.reqs, nums)]
    out_loc = torch.cat([table[r.req_pool_idx, r.kv_len : r.kv_len + n]
                         for r, n in zip(plan.reqs, nums)])
    trees = plan.has_trees
    mode = (ForwardMode.TARGET_VERIFY if trees else
            ForwardMode.DECODE if all(n == 1 for n in nums) else ForwardMode.EXTEND)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(plan.items),
        input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
        positions=torch.tensor(pos, dtype=torch.int64, device=dev),
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        extend_seq_lens=torch.tensor(nums, dtype=torch.int64, device=dev), out_cache_loc=out_loc,
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend, seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=list(nums), req_pool_indices_cpu=pool_rows,
        logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
        custom_mask=masks if trees else None, custom_mask_tails=tails if trees else None,
        capture_layers=plan.capture_layers,
    )
    return fb, rows
