"""A step's verifies against the target's logits: the sampling parameters, penalties and
grammar applied per request, then verify.py's acceptance walk. Greedy trees of the whole
step read their argmax from the device in one copy (`greedy_targets`; utils/host_sync.py)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.sampling.sampler import apply_logit_adjustments, greedy_ids, logits_to_probs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.grammar_verify import verify_with_grammar
from sglang.srt.speculative.tree import DraftTree
from sglang.srt.speculative.verify import VerifyResult, verify_greedy, verify_sampling
from sglang.srt.utils import host_sync


def greedy_targets(trees: Sequence[Tuple[object, DraftTree, torch.Tensor]],
                   vocab_size: int) -> Dict[str, List[int]]:
    """rid -> the target's argmax at each node, for every greedy request without a grammar
    (a grammar's mask depends on the path walked). trees: (req, tree, logits [len(tree),
    vocab]) per verify of the step."""
    picked = [(r, t, x) for r, t, x in trees
              if r.sampling_params.is_greedy and r.grammar is None]
    if not picked:
        return {}
    logits = torch.cat([x for _, _, x in picked])
    info = SamplingBatchInfo.from_reqs([r for r, _, _ in picked], vocab_size,
                                       device=logits.device
                                       ).expand_rows([len(t) for _, t, _ in picked])
    ids = host_sync.to_list(greedy_ids(apply_logit_adjustments(logits.float(), info)),
                            "verify_ids")
    out, start = {}, 0
    for r, t, _ in picked:
        out[r.rid], start = ids[start: start + len(t)], start + len(t)
    return out


def verify_tree(req, tree: DraftTree, logits: torch.Tensor, vocab_size: int,
                grammar_backend, target_ids: Optional[List[int]] = None) -> VerifyResult:
    """The accepted path of one request's tree; target_ids: its greedy argmax per node when
    `greedy_targets` read them already."""
    if target_ids is None and req.sampling_params.is_greedy and req.grammar is None:
        target_ids = greedy_targets([(req, tree, logits)], vocab_size)[req.rid]
    if target_ids is not None:
        return verify_greedy(tree, target_ids)
    info = SamplingBatchInfo.from_reqs([req], vocab_size, device=logits.device
                                       ).expand_rows([len(tree)])
    adjusted = apply_logit_adjustments(logits.float(), info)
    if req.grammar is not None:
        return verify_with_grammar(req, tree, adjusted, info, grammar_backend)
    # the acceptance walk reads many entries: one copy to the host, not one read each
    probs = host_sync.to_cpu(logits_to_probs(adjusted, info), "verify_probs")
    return verify_sampling(tree, probs, req.generator)
