"""SamplingParams: parsing what clients send and rejecting what cannot be served."""

from __future__ import annotations

import pytest

from sglang.srt.sampling.sampling_params import SamplingParams

# The body sglang's RuntimeEndpoint (frontend DSL) sends for `gen`: explicit nulls, empty lists.
FRONTEND_BODY = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
    "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
    "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None,
}


def test_from_dict_accepts_frontend_body():
    sp = SamplingParams.from_dict(FRONTEND_BODY)
    sp.verify()
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.stop_regex == []
    assert sp.max_new_tokens == 16 and sp.is_greedy


def test_from_dict_explicit_nulls_keep_defaults():
    keys = ["stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
            "n", "logit_bias", "sampling_seed", "frequency_penalty", "repetition_penalty"]
    sp = SamplingParams.from_dict({k: None for k in keys})
    sp.verify()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n) == (1.0, 1.0, -1, 0.0, 1)
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.stop_regex == []


def test_from_dict_normalises_single_strings_and_empty_dict():
    sp = SamplingParams.from_dict({"stop": "\n", "stop_regex": r"\d+"})
    assert sp.stop == ["\n"] and sp.stop_regex == [r"\d+"]
    assert SamplingParams.from_dict(None) == SamplingParams.from_dict({})


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 3})


@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=1e-7), dict(top_p=1.0), dict(top_k=-1),
    dict(top_k=1), dict(min_p=1.0), dict(min_p=0.0), dict(frequency_penalty=-2.0),
    dict(presence_penalty=2.0), dict(repetition_penalty=2.0), dict(max_new_tokens=0),
    dict(max_new_tokens=None), dict(min_new_tokens=5, max_new_tokens=5), dict(regex="a+"),
    dict(temperature=1), dict(logit_bias={"3": -100.0}), dict(stop_token_ids=[0, 9]),
])
def test_verify_accepts_valid(params):
    SamplingParams.from_dict(params).verify(vocab_size=10)


@pytest.mark.parametrize("params,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_new_tokens=10, max_new_tokens=5), "min_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(n=0), "n"),
    (dict(regex="a", json_schema="{}"), "regex"),
    (dict(ebnf="root ::= 'a'", json_schema="{}"), "regex"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p="1"), "top_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens="16"), "max_new_tokens"),
    (dict(temperature=True), "temperature"),
    (dict(stop_token_ids=[10]), "stop_token_ids"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={"10": 1.0}), "logit_bias"),
])
def test_verify_rejects_invalid(params, field):
    sp = SamplingParams.from_dict(params)
    with pytest.raises(ValueError, match=field):
        sp.verify(vocab_size=10)


@pytest.mark.parametrize("params", [
    dict(temperature=float("nan")),
    dict(logit_bias={"3": "abc"}),
    dict(logit_bias={"3": float("nan")}),
    dict(stop=[1]),
])
def test_verify_rejects_values_that_break_sampling(params):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(params).verify(vocab_size=10)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
