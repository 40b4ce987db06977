"""Verifying a draft tree under a grammar (regex / json_schema / ebnf)."""

from __future__ import annotations

import dataclasses

import torch

from sglang.srt.sampling.sampler import logits_to_probs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.tree import DraftTree
from sglang.srt.speculative.verify import VerifyResult, verify_greedy, verify_sampling
from sglang.srt.utils import host_sync


def verify_with_grammar(req, tree: DraftTree, adjusted: torch.Tensor, info: SamplingBatchInfo,
                        grammar_backend) -> VerifyResult:
    """Walk the tree with the request's matcher: each accepted node's distribution is
    masked by the grammar state after the path so far, so a drafted token the grammar
    forbids has probability 0 and is rejected. Leaves the matcher after the path and the
    bonus token. adjusted: [len(tree), vocab] logits after penalties and bias."""
    matcher = req.grammar

    def row(node: int) -> torch.Tensor:
        if node:
            matcher.accept_token(tree.tokens[node])
        mask = grammar_backend.forbidden_mask([matcher])[0]
        return adjusted[node].masked_fill(mask, float("-inf"))

    if req.sampling_params.is_greedy:
        # one read per node: each node's mask depends on the path before it
        result = verify_greedy(
            tree, lambda n: host_sync.to_int(row(n).argmax(), "grammar_verify"))
    else:
        one = dataclasses.replace(info, vocab_mask=None)
        result = verify_sampling(
            tree, lambda n: logits_to_probs(row(n).unsqueeze(0), _row_info(one, n))[0],
            req.generator)
    matcher.accept_token(result.tokens[-1])
    return result


def _row_info(info: SamplingBatchInfo, row: int) -> SamplingBatchInfo:
    """The sampling parameters of one row of an expanded batch."""
    sl = slice(row, row + 1)
    return dataclasses.replace(info, temperatures=info.temperatures[sl], top_ps=info.top_ps[sl],
                               top_ks=info.top_ks[sl], min_ps=info.min_ps[sl],
                               is_greedy=info.is_greedy[sl], generators=info.generators[sl],
                               greedy_host=info.greedy_host[sl], top_ks_host=info.top_ks_host[sl],
                               top_ps_host=info.top_ps_host[sl],
                               penalties=None, vocab_mask=None)
