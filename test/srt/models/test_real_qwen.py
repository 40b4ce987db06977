"""The real Qwen2.5-Coder-Instruct Q4_K_M pair (0.5B draft, 1.5B target) through our loader.

Skipped unless `python scripts/fetch_real_models.py` has put the GGUFs under
~/.cache/sglang-fork/models (CI does not download them). Checks: config from metadata
(qwen2, untied lm_head as the files say), one shared tokenizer, every dequantized
parameter equal to transformers' GGUF load, and float32 greedy tokens equal to
transformers' for 32 tokens. About 2.5 min for the 0.5B on 2 cores (transformers' GGUF
conversion alone takes ~70 s). The 1.5B gets config and tokenizer checks by default; its
float32 comparison with transformers (~14 GB of RAM, ~4 min) runs only with
SGLANG_TEST_REAL_TARGET=1.

The helpers in sglang.test.real_assets are also checked here, without any fetched file.
"""

from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch

from sglang.srt.model_loader.gguf_loader import GGUFFile
from sglang.srt.model_loader.loader import load_config, load_tokenizer
from sglang.test import real_assets
from sglang.test.harness import TinyRunner

PROMPT = "Article 6 of the GDPR says that processing shall be lawful only if"
LEGAL_SAMPLE = (
    "Article 17 - Right to erasure ('right to be forgotten')\n1. The data subject shall have "
    "the right to obtain from the controller the erasure of personal data concerning him or "
    "her without undue delay; the fee is EUR 1,250.00 per request (§ 4(2)(b))."
)
# size -> (layers, hidden, heads, kv heads); both have vocab 151936
SHAPES = {"0.5b": (24, 896, 14, 2), "1.5b": (28, 1536, 12, 2)}


def _gguf(size: str) -> str:
    path = real_assets.qwen_gguf(size)
    if path is None:
        pytest.skip(f"Qwen2.5-Coder-{size} GGUF absent: run scripts/fetch_real_models.py")
    return path


def _hf_gguf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def _hf_reference(model: torch.nn.Module, name: str, hf: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The HF tensor(s) that our parameter `name` holds (fused ones concatenated by rows)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([hf[name.replace(fused, p)] for p in parts])
    return hf[name]


def _teacher_forced_argmax(hf_model, prompt: List[int], generated: List[int]) -> List[int]:
    """transformers' argmax after the prompt and after each generated token but the last:
    our greedy tokens equal transformers' greedy tokens iff this equals `generated`."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated[:-1]])).logits[0]  # [len, vocab]
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


# ---- helpers, no fetched files needed ----------------------------------------------------------


def test_helpers_return_none_when_absent(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert real_assets.models_dir() == str(tmp_path / "sglang-fork" / "models")
    assert real_assets.qwen_pair() is None and real_assets.qwen_gguf("1.5B") is None
    assert real_assets.legal_doc("gdpr") is None and real_assets.legal_text("gdpr") is None
    assert real_assets.legal_docs() == [] and real_assets.legal_index() == {}
    with pytest.raises(ValueError, match="0.5b"):
        real_assets.qwen_gguf("7b")


def test_legal_lookup_by_name(tmp_path, monkeypatch, smollm2_path: str) -> None:
    tok = load_tokenizer(smollm2_path)  # before moving the cache root: keep its tokenizer cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    os.makedirs(real_assets.legal_dir())
    with open(os.path.join(real_assets.legal_dir(), "ai_act.txt"), "w", encoding="utf-8") as f:
        f.write(LEGAL_SAMPLE)
    assert real_assets.legal_doc("AI Act") == real_assets.legal_doc("ai_act.txt") is not None
    assert real_assets.legal_docs() == ["ai_act"]
    assert real_assets.legal_text("ai_act", max_tokens=10**6, tokenizer=tok) == LEGAL_SAMPLE


def test_truncate_to_tokens_cuts_on_a_token_boundary(smollm2_path: str) -> None:
    tok = load_tokenizer(smollm2_path)
    ids = tok(LEGAL_SAMPLE, add_special_tokens=False).input_ids
    for n in (1, 7, len(ids) - 1):
        cut = real_assets.truncate_to_tokens(LEGAL_SAMPLE, n, tok)
        assert LEGAL_SAMPLE.startswith(cut)
        assert tok(cut, add_special_tokens=False).input_ids == ids[:n]
    assert real_assets.truncate_to_tokens(LEGAL_SAMPLE, len(ids), tok) == LEGAL_SAMPLE
    assert real_assets.truncate_to_tokens(LEGAL_SAMPLE, 0, tok) == ""


# ---- the real files -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["0.5b", "1.5b"])
def test_config_from_metadata(size: str) -> None:
    from gguf import GGMLQuantizationType as Q

    path = _gguf(size)
    gf, cfg = GGUFFile(path), load_config(path)
    layers, hidden, heads, kv_heads = SHAPES[size]
    assert cfg.architectures == ["Qwen2ForCausalLM"] and gf.metadata["general.architecture"] == "qwen2"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (layers, hidden, heads, kv_heads, 151936)
    # Tied or not is whatever the file says; both of these files carry output.weight.
    assert cfg.tie_word_embeddings == ("output.weight" not in gf.tensors)
    assert gf.metadata["general.file_type"] == 15  # llama.cpp MOSTLY_Q4_K_M
    assert {Q.Q4_K, Q.Q6_K} & {Q(t.qtype) for t in gf.tensors.values()}


def test_draft_and_target_share_one_tokenizer() -> None:
    draft, target = _gguf("0.5b"), _gguf("1.5b")
    a, b = GGUFFile(draft).metadata, GGUFFile(target).metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.pre"):
        assert a.get(key) == b.get(key), key
    tok_a, tok_b = load_tokenizer(draft), load_tokenizer(target)
    text = real_assets.legal_text("gdpr", max_tokens=4000, tokenizer=tok_a) or LEGAL_SAMPLE
    ids = tok_a(text).input_ids
    assert ids == tok_b(text).input_ids and len(ids) > 10
    assert tok_a.decode(ids) == text
    assert tok_a.eos_token == tok_b.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "Summarise Article 6."}]
    assert tok_a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok_b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def draft_hf():
    return _hf_gguf(_gguf("0.5b"))


def test_draft_float32_matches_transformers(draft_hf) -> None:
    path = _gguf("0.5b")
    runner = TinyRunner(path, dtype="float32", max_reqs=1, max_context=256, kv_slots=256)
    model = runner.model
    # Every dequantized parameter (Q4_K, Q5_0, Q6_K, Q8_0, F32) equals transformers' own load.
    hf_params = dict(draft_hf.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, _hf_reference(model, name, hf_params)), name
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, as in the file
    prompt = load_tokenizer(path)(PROMPT).input_ids
    with torch.no_grad():
        ref = draft_hf(torch.tensor([prompt])).logits[0]  # [len, vocab]
    ours = runner.prefill([prompt], all_logits=True)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    runner.release()
    generated = runner.generate_greedy([prompt], 32)[0]
    assert generated == _teacher_forced_argmax(draft_hf, prompt, generated)
    assert runner.allocator.available_size() == runner.allocator.size  # nothing leaked


def test_draft_bfloat16_default_agrees_on_next_token(draft_hf) -> None:
    """`auto` loads a GGUF in bf16; its next token after a legal prompt is float32's."""
    path = _gguf("0.5b")
    runner = TinyRunner(path, dtype="auto", max_reqs=1, max_context=64, kv_slots=64)
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    prompt = load_tokenizer(path)(PROMPT).input_ids
    with torch.no_grad():
        ref = draft_hf(torch.tensor([prompt])).logits[0, -1]
    assert runner.prefill([prompt])[0].argmax().item() == ref.argmax().item()


@pytest.mark.skipif(os.environ.get("SGLANG_TEST_REAL_TARGET") != "1",
                    reason="heavy (~14 GB, ~4 min): set SGLANG_TEST_REAL_TARGET=1")
def test_target_float32_prompt_logits_match_transformers() -> None:
    """The 1.5B in float32, logits over a short prompt only (ours + transformers' ~14 GB)."""
    path = _gguf("1.5b")
    prompt = load_tokenizer(path)(PROMPT).input_ids
    runner = TinyRunner(path, dtype="float32", max_reqs=1, max_context=64, kv_slots=64)
    ours = runner.prefill([prompt], all_logits=True)  # [len, vocab]
    del runner
    hf = _hf_gguf(path)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
