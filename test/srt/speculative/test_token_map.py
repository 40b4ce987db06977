"""--speculative-token-map: the draft scores only the map's tokens; output stays exact."""

from __future__ import annotations

import json

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.token_map import HotVocabHead, load_token_map
from sglang.test.eagle_fixtures import (build_tiny_deepseek_mtp, build_tiny_eagle3_head,
                                        build_tiny_eagle_head)
from sglang.test.scheduler_driver import greedy, make_scheduler, run


def test_hot_vocab_head_scores_only_the_map():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    ids = torch.tensor([3, 7, 8, 41])
    head = HotVocabHead(w, ids)
    x = torch.randn(2, 8, generator=g)
    out = head(x)
    assert out.shape == (2, 50) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, ids], x @ w[ids].T)
    rest = torch.ones(50, dtype=torch.bool)
    rest[ids] = False
    assert torch.isinf(out[:, rest]).all() and (out[:, rest] < 0).all()


def test_load_token_map_formats_and_errors(tmp_path):
    pt, js, txt = tmp_path / "m.pt", tmp_path / "m.json", tmp_path / "m.txt"
    torch.save(torch.tensor([5, 1, 5, 9]), pt)
    js.write_text(json.dumps([9, 1, 5]))
    txt.write_text("1\n5\n9\n")
    for p in (pt, js, txt):
        assert load_token_map(str(p), 10).tolist() == [1, 5, 9]
    with pytest.raises(ValueError, match="outside the draft's vocabulary"):
        load_token_map(str(pt), 8)
    with pytest.raises(ValueError, match="not a file"):
        load_token_map(str(tmp_path / "missing.pt"), 10)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read token ids"):
        load_token_map(str(bad), 10)


def test_token_map_flag_checks(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        ServerArgs(model_path="x", speculative_algorithm="STANDALONE",
                   speculative_draft_model_path="y", speculative_token_map=str(tmp_path / "no"))
    with pytest.raises(ValueError, match="STANDALONE, HYBRID, EAGLE or NEXTN"):
        ServerArgs(model_path="x", speculative_algorithm="NGRAM",
                   speculative_token_map=str(tmp_path))
    with pytest.raises(ValueError, match="own reduced vocabulary"):
        ServerArgs(model_path="x", speculative_algorithm="EAGLE3",
                   speculative_draft_model_path="y", speculative_token_map=str(tmp_path))


def _map_of_plain_tokens(target_dir, tmp_path, prompts):
    """Plain's greedy tokens and a map: the tokens plain produces for the first two prompts,
    plus ids 0-99 (the third prompt's tokens mostly lie outside it)."""
    ref = run(make_scheduler(target_dir), prompts, [greedy(24)] * 3)
    hot = sorted({t for i in ("0", "1") for t in ref[i][0]} | set(range(100)))
    path = tmp_path / "map.pt"
    torch.save(torch.tensor(hot), path)
    return ref, hot, str(path)


def _spy_proposals(sched) -> list:
    proposed = []
    drafter = sched.spec.drafter
    grow = drafter._grow

    def spy(reqs, *a, **k):
        trees = grow(reqs, *a, **k)
        proposed.extend(int(t) for tree in trees if tree is not None for t in tree.tokens[1:])
        return trees

    drafter._grow = spy
    return proposed


def test_token_map_is_lossless_and_limits_proposals(tiny_llama_dir, tmp_path):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 3000, (9,), generator=g).tolist() * 2 for _ in range(3)]
    ref, hot, path = _map_of_plain_tokens(tiny_llama_dir, tmp_path, prompts)
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_dir, speculative_num_steps=3,
                           speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                           speculative_token_map=path)
    proposed = _spy_proposals(sched)
    got = run(sched, prompts, [greedy(24)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids  # exact, map or not
    assert proposed and set(proposed) <= set(hot)
    # Draft == target on the mapped prompts: still accepts runs of tokens.
    assert got["0"][1].extra_meta["spec_accept_length"] > 1.5
    sched.check_all_free()


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN"])
def test_head_drafts_only_from_the_map_and_stay_lossless(algorithm, tiny_llama_dir, tmp_path):
    """FR-Spec for heads: the head scores the map's rows of the target's lm_head; the target
    still verifies over its whole vocabulary, so the tokens are plain's."""
    if algorithm == "EAGLE":
        target = tiny_llama_dir
        head = build_tiny_eagle_head(target, str(tmp_path / "head"))
    else:
        target = head = build_tiny_deepseek_mtp(str(tmp_path / "ds"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 3000, (8,), generator=g).tolist() * 2 for _ in range(3)]
    ref, hot, path = _map_of_plain_tokens(target, tmp_path, prompts)
    sched = make_scheduler(target, speculative_algorithm=algorithm,
                           speculative_draft_model_path=head, speculative_num_steps=3,
                           speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                           speculative_token_map=path)
    drafter = sched.spec.drafter
    assert isinstance(drafter.head.lm_head, HotVocabHead)
    assert drafter.head.lm_head.weight.shape[0] == len(hot)  # the cost model's smaller head
    assert not isinstance(sched.runner.model.lm_head, HotVocabHead)  # verify: whole vocab
    proposed = _spy_proposals(sched)
    got = run(sched, prompts, [greedy(24)] * 3)
    for rid, (ids, _) in ref.items():
        assert got[rid][0] == ids
    assert proposed and set(proposed) <= set(hot)
    sched.check_all_free()


def test_an_eagle3_head_under_hybrid_refuses_a_token_map(tiny_llama_dir, tmp_path):
    head = build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path / "h3"))
    path = tmp_path / "map.pt"
    torch.save(torch.arange(100), path)
    with pytest.raises(ValueError, match="own reduced vocabulary"):
        make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                       speculative_draft_model_path=head, speculative_token_map=str(path))
