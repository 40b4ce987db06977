"""Sampling with an EAGLE-3 head follows the target's distribution, end to end.

A logit bias puts the tiny target's mass on four tokens (unequally); the head's reduced
draft vocabulary is those four tokens, so its drafts are always candidates and the
verifier's accept and reject paths both run (a tree of width 2). 1200 seeded requests of
three tokens: the first comes from the prefill (plain sampling), the second and third from
verifies; each is checked against the target's exact distribution (chi-square). A verifier
that favoured the draft's choices would over-represent the head's favourite token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sglang.test.eagle_fixtures import build_tiny_eagle3_head
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import make_scheduler, run

TOKENS = [101, 202, 303, 404]
BIAS = {101: 30.0, 202: 30.8, 303: 31.3, 404: 29.6}
PROMPT = [5, 17, 230, 941, 77, 1200, 33]


def _target_probs(target_dir, seqs):
    """p(next | seq) over TOKENS for each seq (the biased target; the rest of the vocabulary
    holds ~e^-29 of the mass)."""
    runner = TinyRunner(target_dir, max_reqs=len(seqs))
    logits = runner.prefill(seqs).double()
    runner.release()
    bias = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for t, b in BIAS.items():
        bias[t] = b
    p = torch.softmax(logits + bias, -1)[:, TOKENS]
    return p / p.sum(-1, keepdim=True)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_with_a_head(tiny_llama_dir, tmp_path):
    head = build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path / "h"), seed=2,
                                  draft_ids=TOKENS, scale=0.5)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="EAGLE3",
                           speculative_draft_model_path=head, speculative_num_steps=2,
                           speculative_eagle_topk=2, max_running_requests=64)
    n = 1200
    params = [{"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True,
               "logit_bias": {str(t): b for t, b in BIAS.items()}, "sampling_seed": i}
              for i in range(n)]
    got = run(sched, [PROMPT] * n, params)
    outs = [got[str(i)][0] for i in range(n)]
    assert all(len(o) == 3 and set(o) <= set(TOKENS) for o in outs)
    accepted = sum(u.extra_meta.get("spec_accept_length", 1) > 1 for _, u in got.values())
    assert accepted > n // 10, "the head's drafts should be accepted in part"
    sched.check_all_free()

    idx = {t: i for i, t in enumerate(TOKENS)}
    p1 = _target_probs(tiny_llama_dir, [PROMPT])[0].numpy()
    first = np.bincount([idx[o[0]] for o in outs], minlength=4)
    assert chisquare(first, p1 * n).pvalue > 1e-3
    p2 = _target_probs(tiny_llama_dir, [PROMPT + [t] for t in TOKENS]).numpy()
    for a, t in enumerate(TOKENS):  # the second token given the first: a verify's
        seconds = [idx[o[1]] for o in outs if o[0] == t]
        counts = np.bincount(seconds, minlength=4)
        assert chisquare(counts, p2[a] * len(seconds)).pvalue > 1e-3
    pairs = list(itertools.product(TOKENS, TOKENS))
    p3 = _target_probs(tiny_llama_dir, [PROMPT + list(pq) for pq in pairs]).numpy()
    joint = {pq: p1[idx[pq[0]]] * p2[idx[pq[0]], idx[pq[1]]] for pq in pairs}
    expected3 = sum(joint[pq] * p3[k] for k, pq in enumerate(pairs))
    third = np.bincount([idx[o[2]] for o in outs], minlength=4)
    assert chisquare(third, expected3 * n).pvalue > 1e-3
