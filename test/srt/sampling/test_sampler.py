"""Batched sampler: filters, draws, seeds, penalties and logprobs (CPU, small vocabularies)."""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Set

import pytest
import torch

from sglang.srt.sampling.sampler import (
    apply_logit_adjustments,
    draw_from_probs,
    greedy_ids,
    logits_to_probs,
    sample,
    token_logprob,
    top_logprobs,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclasses.dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: List[int]
    output_ids: List[int]
    generator: Optional[torch.Generator]
    stop_token_ids_all: Set[int]


def make_req(prompt=(), output=(), seed: Optional[int] = None, stops=(), **params) -> FakeReq:
    sp = SamplingParams(**params)
    sp.normalize()
    sp.verify()
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return FakeReq(sp, list(prompt), list(output), gen, set(stops))


def info_for(*reqs: FakeReq, vocab: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(list(reqs), vocab)


def probs_logits(probs: List[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, vocab]


# ---- greedy and temperature -------------------------------------------------------------

def test_greedy_is_argmax_and_ties_take_lowest_index():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1.0  # a tie
    reqs = [make_req(temperature=0.0), make_req(temperature=0.7, top_k=1), make_req(temperature=0)]
    out = sample(logits, info_for(*reqs, vocab=50))
    assert out.next_token_ids.tolist() == [int(logits[0].argmax()), int(logits[1].argmax()), 7]
    assert out.next_token_ids.dtype == torch.int64
    probs = logits_to_probs(logits, info_for(*reqs, vocab=50))
    assert probs[2, 7] == 1.0 and probs[2].sum() == 1.0


def test_greedy_rows_consume_no_randomness():
    gen = torch.Generator().manual_seed(5)
    req = FakeReq(SamplingParams(temperature=0.0), [], [], gen, set())
    state = gen.get_state()
    sample(torch.randn(1, 20), info_for(req, vocab=20))
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(temperature):
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, info_for(make_req(temperature=temperature), vocab=30))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


# ---- filters -----------------------------------------------------------------------------

def test_top_k_keeps_k_most_likely_tokens():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2))
    info = info_for(make_req(top_k=5), make_req(top_k=17), vocab=100)
    probs = logits_to_probs(logits, info)
    for row, k in ((0, 5), (1, 17)):
        kept = torch.nonzero(probs[row]).flatten()
        assert set(kept.tolist()) == set(torch.topk(logits[row], k).indices.tolist())
        expected = torch.softmax(logits[row, kept], dim=-1)
        torch.testing.assert_close(probs[row, kept], expected)


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.randn(1, 10)
    info = info_for(make_req(top_k=1000), vocab=10)
    assert not info.need_top_k
    torch.testing.assert_close(logits_to_probs(logits, info), torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p,kept", [(0.3, [0]), (0.6, [0, 1]), (0.75, [0, 1, 2]),
                                        (0.95, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, info_for(make_req(top_p=top_p), vocab=4))
    assert torch.nonzero(probs[0]).flatten().tolist() == kept
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])[kept]
    torch.testing.assert_close(probs[0, kept], base / base.sum())


def reference_top_p(probs_row: torch.Tensor, p: float) -> torch.Tensor:
    """Plain full-sort top-p, for checking the partial-sort fast path."""
    vals, idx = torch.sort(probs_row, descending=True)
    keep = (torch.cumsum(vals, 0) - vals) < p
    keep[0] = True
    out = torch.zeros_like(probs_row)
    out[idx[keep]] = vals[keep]
    return out / out.sum()


def test_top_p_on_flat_distribution_matches_full_sort():
    # A flat distribution needs far more than the first 256 sorted tokens: the head must grow.
    vocab = 3000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    with_k = make_req(top_p=0.9, top_k=2500)
    topk_probs = logits_to_probs(logits[1:], info_for(make_req(top_k=2500), vocab=vocab))[0]
    expected_k = reference_top_p(topk_probs, 0.9)
    # Alone (head grows up to top_k) and beside a row without top-k (head grows to a sort).
    torch.testing.assert_close(logits_to_probs(logits[1:], info_for(with_k, vocab=vocab))[0],
                               expected_k)
    probs = logits_to_probs(logits, info_for(make_req(top_p=0.5), with_k, vocab=vocab))
    torch.testing.assert_close(probs[0], reference_top_p(torch.softmax(logits[0], -1), 0.5))
    torch.testing.assert_close(probs[1], expected_k)


def test_top_p_applies_to_top_k_renormalised_distribution():
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    # After top-k=2: [4/7, 3/7]; top_p=0.5 keeps only the first (4/7 >= 0.5).
    probs = logits_to_probs(logits, info_for(make_req(top_k=2, top_p=0.5), vocab=4))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    probs = logits_to_probs(logits, info_for(make_req(min_p=0.2), vocab=4))
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_filters_only_touch_rows_that_ask():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    info = info_for(make_req(), make_req(top_p=0.5, min_p=0.1), make_req(top_k=3), vocab=40)
    probs = logits_to_probs(logits, info)
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], -1))
    assert int((probs[2] > 0).sum()) == 3


# ---- drawing -----------------------------------------------------------------------------

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi2_critical(df: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CHI2_999[df]
    return float(chi2.ppf(0.999, df))


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.3, top_k=6),
                                    dict(top_p=0.9, min_p=0.05)])
def test_draws_follow_processed_distribution(params):
    n = 30000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    info = info_for(make_req(seed=1234, **params), vocab=8)
    target = logits_to_probs(logits, info)[0].double()  # [8]
    many = info.expand_rows([n])
    ids = sample(logits.expand(n, 8), many).next_token_ids
    counts = torch.bincount(ids, minlength=8).double()
    support = target > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    expected = target[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(int(support.sum()) - 1), (stat, counts, expected)


def test_draw_never_returns_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(2000, 5)
    ids = draw_from_probs(probs, [torch.Generator().manual_seed(0)] * 2000)
    assert set(ids.tolist()) == {1, 3}


def test_seed_gives_same_tokens_alone_or_in_any_batch():
    vocab, steps = 500, 12
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(9)) * 2

    def run(batch_of: int, position: int) -> List[int]:
        params = dict(temperature=0.9, top_p=0.8, top_k=200)
        me = make_req(seed=77, **params)
        others = [make_req(temperature=0.0), make_req(seed=1, top_p=0.5, min_p=0.1),
                  make_req(seed=2, temperature=1.5, repetition_penalty=1.3, prompt=[1, 2])]
        reqs = others[: batch_of - 1]
        reqs.insert(position, me)
        noise = torch.Generator().manual_seed(position)
        tokens = []
        for step in range(steps):
            logits = torch.randn(batch_of, vocab, generator=noise)
            logits[position] = step_logits[step]
            out = sample(logits, SamplingBatchInfo.from_reqs(reqs, vocab))
            for req, tok in zip(reqs, out.next_token_ids.tolist()):
                req.output_ids.append(tok)
            tokens.append(int(out.next_token_ids[position]))
        return tokens

    alone = run(1, 0)
    assert run(4, 0) == alone
    assert run(4, 2) == alone
    assert len(set(alone)) > 1  # really sampled


def test_unseeded_rows_use_global_rng():
    logits = torch.zeros(1, 1000)
    info = info_for(make_req(), vocab=1000)
    torch.manual_seed(3)
    first = sample(logits, info).next_token_ids
    torch.manual_seed(3)
    assert torch.equal(sample(logits, info).next_token_ids, first)


# ---- penalties, bias, min_new_tokens -----------------------------------------------------

def test_no_penalty_state_when_no_request_uses_one():
    info = info_for(make_req(output=[1, 1]), make_req(temperature=0, prompt=[3]), vocab=10)
    assert info.penalties is None


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(2, 10)
    req = make_req(prompt=[7], output=[3, 3, 5], frequency_penalty=0.5, presence_penalty=0.25)
    plain = make_req(prompt=[7], output=[3, 3, 5])
    adjusted = apply_logit_adjustments(logits, info_for(req, plain, vocab=10))
    expected = torch.zeros(2, 10)
    expected[0, 3] = -(0.5 * 2 + 0.25)
    expected[0, 5] = -(0.5 * 1 + 0.25)
    torch.testing.assert_close(adjusted, expected)
    assert torch.equal(logits, torch.zeros(2, 10)), "input must not be modified"


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 2.0, -1.0, 0.5]])
    req = make_req(prompt=[0], output=[1], repetition_penalty=2.0)
    adjusted = apply_logit_adjustments(logits, info_for(req, vocab=5))
    torch.testing.assert_close(adjusted, torch.tensor([[1.0, -2.0, 2.0, -1.0, 0.5]]))


def test_logit_bias_forces_a_token():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(5))
    reqs = [make_req(temperature=0, logit_bias={"4": 100.0}),
            make_req(seed=0, logit_bias={"11": 100.0, "999": 5.0})]  # 999: outside vocab
    for _ in range(5):
        assert sample(logits, info_for(*reqs, vocab=20)).next_token_ids.tolist() == [4, 11]


def test_min_new_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[10.0, 1.0, 5.0, 0.0]])  # EOS id 0 is by far the most likely
    short = make_req(output=[3], stops=[0, 2], min_new_tokens=2, temperature=0)
    assert sample(logits, info_for(short, vocab=4)).next_token_ids.tolist() == [1]
    sampled = make_req(output=[3], stops=[0, 2], min_new_tokens=2, seed=0)
    ids = sample(logits.expand(500, 4), info_for(sampled, vocab=4).expand_rows([500]))
    assert set(ids.next_token_ids.tolist()) <= {1, 3}
    done = make_req(output=[3, 3], stops=[0, 2], min_new_tokens=2, temperature=0)
    assert sample(logits, info_for(done, vocab=4)).next_token_ids.tolist() == [0]


def test_expand_rows_repeats_parameters_and_penalties():
    reqs = [make_req(output=[1], presence_penalty=1.0, temperature=0.5),
            make_req(temperature=0)]
    info = info_for(*reqs, vocab=4).expand_rows([2, 3])
    assert info.batch_size == 5
    assert info.is_greedy.tolist() == [False, False, True, True, True]
    adjusted = apply_logit_adjustments(torch.zeros(5, 4), info)
    assert adjusted[:, 1].tolist() == [-1.0, -1.0, 0.0, 0.0, 0.0]


# ---- logprobs ----------------------------------------------------------------------------

def test_logprobs_use_adjusted_logits_and_temperature():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(6))
    reqs = [make_req(seed=0, temperature=0.5, top_k=4, frequency_penalty=1.0, output=[2]),
            make_req(temperature=0.0)]
    info = info_for(*reqs, vocab=16)
    out = sample(logits, info, return_logprobs=True)
    adjusted = logits.clone()
    adjusted[0, 2] -= 1.0
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(adjusted[0] / 0.5, -1))
    torch.testing.assert_close(out.logprobs[1], torch.log_softmax(logits[1], -1))
    assert sample(logits, info).logprobs is None


def test_logprobs_of_masked_tokens_are_finite():
    req = make_req(temperature=0, output=[], stops=[1], min_new_tokens=1)
    out = sample(torch.zeros(1, 4), info_for(req, vocab=4), return_logprobs=True)
    assert math.isfinite(token_logprob(out.logprobs[0], 1))
    assert out.logprobs[0, 1] < -1e30


def test_top_logprobs_best_first_and_token_logprob():
    row = torch.log_softmax(torch.tensor([0.1, 3.0, -2.0, 1.0]), -1)
    best = top_logprobs(row, 2)
    assert [tok for _, tok in best] == [1, 3]
    assert best[0][0] == pytest.approx(float(row[1]))
    assert isinstance(best[0][0], float) and isinstance(best[0][1], int)
    assert top_logprobs(row, 0) == [] and len(top_logprobs(row, 10)) == 4
    assert token_logprob(row, 2) == pytest.approx(float(row[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_is_torch_argmax(dtype: torch.dtype) -> None:
    """The blocked argmax picks torch.argmax's index on every row: ties (the first one), NaNs
    (the first, counted as the maximum), all -inf, a vocab with a short last block, and one
    below the blocked path's size."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = int(torch.randint(2 * 256, 6000, (1,), generator=g)) if trial else 151936
        rows = int(torch.randint(1, 12, (1,), generator=g))
        x = torch.randint(-3, 3, (rows, vocab), generator=g).to(dtype)  # many ties
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=g) < 0.001] = float("nan")
        if trial % 5 == 0:
            x[0] = float("-inf")
        assert torch.equal(greedy_ids(x), torch.argmax(x, dim=-1)), f"trial {trial} V={vocab}"
