"""Acceptance math: tree building, greedy walk, and the sampling verifier's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sglang.srt.speculative.tree import DraftTree, select_best
from sglang.srt.speculative.verify import verify_greedy, verify_sampling


def small_tree() -> DraftTree:
    # root -> (1: tok 3, 2: tok 1); 1 -> (3: tok 0); 2 -> (4: tok 2)
    t = DraftTree.root_only(5)
    a = t.add(3, 0, -0.1)
    b = t.add(1, 0, -0.5)
    t.add(0, a, -0.3)
    t.add(2, b, -0.9)
    return t


def test_attention_mask_sees_prefix_and_ancestors_only():
    t = small_tree()
    m = t.attention_mask(prefix_len=2)
    assert m.shape == (5, 7)
    assert m[:, :2].all()
    assert m[3, 2:].tolist() == [True, True, False, True, False]  # root, node 1, itself
    assert m[4, 2:].tolist() == [True, False, True, False, True]


def test_select_best_keeps_closed_top_nodes():
    t = small_tree()
    best = select_best(t, 3)
    assert best.tokens == [5, 3, 0]  # scores -0.1, -0.3 beat -0.5
    assert best.parents == [-1, 0, 1]
    assert len(select_best(t, 10)) == 5


def test_greedy_walk_and_bonus():
    t = small_tree()
    # target argmax per node: root->1 (node 2), node 2 -> 2 (node 4), node 4 -> 7
    res = verify_greedy(t, [1, 9, 2, 9, 7])
    assert res.path == [0, 2, 4] and res.tokens == [1, 2, 7]
    res = verify_greedy(t, [8, 0, 0, 0, 0])
    assert res.path == [0] and res.tokens == [8]


def reference_chain_greedy(target_argmax, draft_argmax, prompt, k, n):
    """Batch-1 reference (gpt-fast style): draft k greedy tokens, keep the matching prefix,
    add the target's token. Returns (output, accepted count per step)."""
    seq, accepted = list(prompt), []
    while len(seq) - len(prompt) < n:
        draft = []
        for _ in range(k):
            draft.append(draft_argmax(seq + draft))
        m = 0
        while m < k and draft[m] == target_argmax(seq + draft[:m]):
            m += 1
        seq += draft[:m] + [target_argmax(seq + draft[:m])]
        accepted.append(m)
    return seq[len(prompt):][:n], accepted


def test_engine_chain_matches_batch1_reference(tiny_llama_dir, tiny_draft_dir):
    """The batched engine path agrees with the plain reference: same tokens, same
    acceptance histogram, for a chain draft with an unrelated draft model."""
    from transformers import AutoModelForCausalLM

    from sglang.test.scheduler_driver import greedy, make_scheduler, run

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_draft_dir, dtype=torch.float32).eval()

    def argmax_of(model):
        @torch.no_grad()
        def f(seq):
            return int(model(torch.tensor([seq])).logits[0, -1].argmax())
        return f

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 3000, (L,), generator=g).tolist() for L in (6, 11, 17)]
    k, n = 3, 16
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_draft_dir, speculative_num_steps=k,
                           speculative_eagle_topk=1)
    got = run(sched, prompts, [greedy(n)] * len(prompts))
    for i, p in enumerate(prompts):
        ref_out, ref_acc = reference_chain_greedy(argmax_of(target), argmax_of(draft), p, k, n)
        out, upd = got[str(i)]
        assert out == ref_out
        hist = [0] * (k + 1)
        # The last step may be cut short by max_new_tokens; compare all full steps.
        for a in ref_acc[:-1]:
            hist[a] += 1
        eng_hist = upd.extra_meta["spec_accept_histogram"] + [0] * (k + 1)
        last = ref_acc[-1]
        eng_minus_last = list(eng_hist[: k + 1])
        # The engine's final step may report fewer accepted tokens (truncated run).
        for a in range(k + 1):
            if eng_minus_last[a] > hist[a] and a <= last:
                eng_minus_last[a] -= 1
                break
        assert eng_minus_last == hist
    sched.check_all_free()


@pytest.mark.parametrize("seed,sharpness", [(0, 1.5), (1, 0.5), (2, 3.0)])
def test_sampling_verifier_follows_target_distribution(seed, sharpness):
    """Tiny vocab (6): the first and second emitted tokens follow p, whatever the draft
    proposes (including tokens p gives no mass). 40K draws detect a 2% bias."""
    vocab = 6
    g = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * sharpness, 0)
    p_child = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * sharpness, 1)
    p_root[5] = 0.0  # a token the target never emits; the draft proposes it anyway
    p_root /= p_root.sum()
    tree = DraftTree.root_only(0)
    kids = [tree.add(x, 0, -float(i)) for i, x in enumerate([2, 5, 0])]
    tree.add(1, kids[0], -5.0)
    tree.add(3, kids[0], -6.0)
    probs = torch.stack([p_root] + [p_child[tree.tokens[i]] for i in range(1, len(tree))])
    gen = torch.Generator().manual_seed(100 + seed)
    draws = 40_000
    first = np.zeros(vocab)
    second = np.zeros((vocab, vocab))
    for _ in range(draws):
        res = verify_sampling(tree, probs, gen)
        first[res.tokens[0]] += 1
        if len(res.tokens) > 1:
            second[res.tokens[0], res.tokens[1]] += 1
    assert first[5] == 0
    keep = p_root.numpy() > 0
    assert chisquare(first[keep], p_root.numpy()[keep] * draws).pvalue > 1e-3
    # Second tokens after an accepted 2 (the only child with grandchildren) follow p(.|2).
    row = second[2]
    assert chisquare(row, p_child[2].numpy() * row.sum()).pvalue > 1e-3
