"""BOS guard: exactly one BOS where the tokenizer adds one, at any length (200K tokens)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sglang.srt.managers.bos_guard import encode_with_bos_guard, guard_bos, tokenizer_adds_bos
from sglang.test.fixtures import smollm2_tokenizer_dir


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def bos_tok(plain_tok):
    """The same vocabulary, but a tokenizer that adds BOS (<|im_start|>, id 1) like Llama's."""
    raw = Tokenizer.from_str(plain_tok.backend_tokenizer.to_str())
    raw.post_processor = TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                            special_tokens=[("<|im_start|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")


def test_detects_whether_tokenizer_adds_bos(plain_tok, bos_tok):
    assert tokenizer_adds_bos(plain_tok) is None
    assert tokenizer_adds_bos(bos_tok) == 1


def test_exactly_one_bos_for_200k_token_text(bos_tok):
    text = "The Supplier shall indemnify the Customer against all losses. " * 20_000
    ids = encode_with_bos_guard(bos_tok, text, 1)
    assert len(ids) > 200_000
    assert ids[0] == 1 and ids[1] != 1
    assert ids.count(1) == 1


def test_text_that_spells_bos_gets_one(bos_tok):
    ids = encode_with_bos_guard(bos_tok, "<|im_start|>user\nhello", 1)
    assert ids[0] == 1 and ids[1] != 1


def test_input_ids_missing_or_repeated_bos(bos_tok):
    body = list(range(5, 200_005))
    assert guard_bos(body, 1)[:2] == [1, 5]
    assert guard_bos([1, 1, 1] + body, 1)[:2] == [1, 5]
    assert guard_bos([1] + body, 1) == [1] + body
    assert len(guard_bos(body, 1)) == len(body) + 1


def test_no_bos_tokenizer_leaves_prompts_alone(plain_tok):
    ids = encode_with_bos_guard(plain_tok, "hello world", tokenizer_adds_bos(plain_tok))
    assert ids == plain_tok("hello world")["input_ids"]
    assert guard_bos([1, 1, 5], None) == [1, 1, 5]
