"""The three select scoring methods, on hand-made logprobs (no model)."""

from __future__ import annotations

import math

import pytest

from sglang.lang.choices import (greedy_token_selection, mean_logprob, token_length_normalized,
                                 unconditional_likelihood_normalized)

CHOICES = ["short", "a longer one", "mid"]


def entries(*logprobs):
    return [[lp, i, f"t{i}"] for i, lp in enumerate(logprobs)]


INPUTS = [entries(-1.0, -3.0), entries(-1.0, -0.5, -0.6, -0.7), entries(-2.0, -0.1)]


def call(method, inputs=INPUTS, uncond=None):
    return method(choices=CHOICES, normalized_prompt_logprobs=[mean_logprob(e) for e in inputs],
                  input_token_logprobs=inputs, output_token_logprobs=[[] for _ in inputs],
                  unconditional_token_logprobs=uncond)


def test_token_length_normalized_picks_best_mean():
    # means: -2.0, -0.7, -1.05
    d = call(token_length_normalized)
    assert d.decision == "a longer one"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-2.0, -0.7, -1.05])


def test_mean_logprob_skips_nulls_and_empty_is_nan():
    assert mean_logprob([[None, 1, "x"], [-2.0, 2, "y"]]) == -2.0
    assert math.isnan(mean_logprob([]))


def test_ties_go_to_the_first_choice():
    same = [entries(-1.0), entries(-1.0), entries(-1.0)]
    assert call(token_length_normalized, same).decision == "short"
    assert call(greedy_token_selection, same).decision == "short"


def test_greedy_token_selection_compares_position_by_position():
    # position 0: "short" and "a longer one" tie at -1.0 (> -2.0); position 1: -0.5 beats -3.0
    d = call(greedy_token_selection)
    assert d.decision == "a longer one"
    # the shorter row is padded with its own mean
    assert d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -3.0, -2.0, -2.0]


def test_greedy_pads_a_prefix_choice_with_its_mean():
    inputs = [entries(-1.0), entries(-1.0, -5.0)]  # "short" pads with -1.0 > -5.0
    d = greedy_token_selection(choices=["short", "long"], normalized_prompt_logprobs=[-1, -3],
                               input_token_logprobs=inputs, output_token_logprobs=[[], []])
    assert d.decision == "short"


def test_unconditional_normalisation_penalises_generic_choices():
    # conditional means favour choice 1, but choice 1 is just as likely unconditionally
    uncond = [entries(None, -3.0), entries(None, -0.5, -0.6, -0.7), entries(None, -2.0)]
    d = call(unconditional_likelihood_normalized, uncond=uncond)
    # diffs: [-1-0, -3+3] -> -0.5; [-1, 0, 0, 0] -> -0.25; [-2-0, -0.1+2] -> -0.05
    assert d.decision == "mid"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.5, -0.25, -0.05])


def test_unconditional_needs_unconditional_logprobs():
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError):
        call(unconditional_likelihood_normalized)
    with pytest.raises(ValueError):
        call(unconditional_likelihood_normalized, uncond=[entries(-1.0)] * 3)
