"""Constrained generation (xgrammar): regex / JSON schema, plain and speculative."""

from __future__ import annotations

import json
import re

import pytest

from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_loader.loader import load_tokenizer
from sglang.srt.server_args import ServerArgs
from sglang.test.scheduler_driver import run

REGEX = r"[0-9]{3}-[a-z]{2,5}\."
# Bounded fields, so even a random tiny model finishes the object within the token limit.
SCHEMA = json.dumps({"type": "object",
                     "properties": {"signed": {"type": "boolean"},
                                    "kind": {"enum": ["sale", "lease", "licence"]},
                                    "party": {"type": "string", "maxLength": 8}},
                     "required": ["signed", "kind", "party"], "additionalProperties": False})


def sched_for(model_dir, tok, **kw):
    if kw.get("speculative_algorithm"):
        kw.setdefault("speculative_disable_cost_model", True)
        kw.setdefault("speculative_fallback_threshold", 0.0)
    return Scheduler(ServerArgs(model_path=model_dir, dtype="float32", max_total_tokens=4096, **kw),
                     tokenizer=tok)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, tok):
    return sched_for(tiny_llama_dir, tok)


PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9]


def texts(tok, got):
    return [tok.decode(got[str(i)][0], skip_special_tokens=True) for i in range(len(got))]


def test_regex_output_matches(plain, tok):
    got = run(plain, PROMPTS, [{"max_new_tokens": 24, "temperature": 0, "regex": REGEX}] * 3)
    for t in texts(tok, got):
        assert re.fullmatch(REGEX, t), t
    plain.check_all_free()


def test_json_schema_output_validates(plain, tok):
    got = run(plain, PROMPTS, [{"max_new_tokens": 64, "temperature": 0, "json_schema": SCHEMA}] * 3)
    for t in texts(tok, got):
        obj = json.loads(t)
        assert set(obj) == {"signed", "kind", "party"} and isinstance(obj["signed"], bool)
        assert obj["kind"] in ("sale", "lease", "licence") and len(obj["party"]) <= 8
    plain.check_all_free()


def test_sampled_regex_output_matches(plain, tok):
    params = [{"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": i, "regex": REGEX}
              for i in range(3)]
    for t in texts(tok, run(plain, PROMPTS, params)):
        assert re.fullmatch(REGEX, t), t


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_speculative_constrained_is_lossless(tiny_llama_dir, tok, plain, algo):
    extra = {"speculative_draft_model_path": tiny_llama_dir} if algo == "STANDALONE" else {}
    spec = sched_for(tiny_llama_dir, tok, speculative_algorithm=algo, **extra)
    for params in ({"max_new_tokens": 24, "temperature": 0, "regex": REGEX},
                   {"max_new_tokens": 64, "temperature": 0, "json_schema": SCHEMA}):
        ref = run(plain, PROMPTS, [params] * 3)
        got = run(spec, PROMPTS, [params] * 3)
        for rid in ref:
            assert got[rid][0] == ref[rid][0]
    spec.check_all_free()


def test_invalid_regex_is_rejected_with_message(plain):
    got = run(plain, [[5, 6]], [{"max_new_tokens": 4, "regex": "([a-z"}])
    reason = got["0"][1].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "regex" in reason["message"]
    plain.check_all_free()
