"""Our models, driven through the real pools and the torch_native backend, against
Hugging Face transformers on the same weights: logits and greedy tokens must agree.

Tiny random llama / qwen2 / mistral models cover each architecture's quirks (GQA, q/k/v
bias, tied embeddings, explicit head_dim, rope scaling); the SmolLM2 GGUF covers the
llama.cpp path (dequantization, Q/K un-permutation, config from metadata).
"""

from __future__ import annotations

import os
from typing import List, Sequence

import pytest
import torch

from sglang.test.harness import TinyRunner

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived"]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def hf_greedy(hf_model, prompt: Sequence[int], n: int) -> List[int]:
    out = hf_model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_same_greedy(ours: List[int], hf: List[int], n: int, eos: Sequence[int]) -> None:
    # HF stops at EOS, we do not: compare up to where HF stopped.
    assert len(hf) == n or hf[-1] in eos, f"HF returned {len(hf)} < {n} tokens without EOS"
    assert ours[: len(hf)] == hf


def check_against_hf(runner: TinyRunner, hf_model, token_lists: List[List[int]], n_new: int) -> None:
    eos = [hf_model.config.eos_token_id] if isinstance(hf_model.config.eos_token_id, int) else []
    # Every position of a prompt, one request.
    with torch.no_grad():
        ref = hf_model(torch.tensor([token_lists[1]])).logits[0]
    ours = runner.prefill([token_lists[1]], all_logits=True)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-3
    runner.release()
    # Greedy tokens of a ragged batch of two prompts (one EXTEND, then DECODE steps).
    generated = runner.generate_greedy(token_lists, n_new)
    for prompt, toks in zip(token_lists, generated):
        assert_same_greedy(toks, hf_greedy(hf_model, prompt, n_new), n_new, eos)
    # Nothing leaked: every KV slot and row is free again.
    assert runner.allocator.available_size() == runner.allocator.size
    assert runner.req_pool.available_size() == runner.req_pool.size


def _hf_from_folder(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _tokenize(folder: str) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_model_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    check_against_hf(TinyRunner(folder), _hf_from_folder(folder), _tokenize(folder), n_new=24)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256, "rope_theta": 10000.0},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_transformers(rope: dict, tmp_path) -> None:
    from sglang.test.fixtures import build_tiny_model

    # head_dim 16 with original context 256 puts frequencies in all three llama3 bands.
    folder = build_tiny_model("llama", str(tmp_path / "m"), rope_parameters=rope)
    tokens = _tokenize(folder)[1]
    with torch.no_grad():
        ref = _hf_from_folder(folder)(torch.tensor([tokens])).logits[0]
    assert rel_err(TinyRunner(folder).prefill([tokens], all_logits=True), ref) < 1e-3


def test_prefix_split_equals_one_shot(tiny_llama_dir: str) -> None:
    """EXTEND over an existing prefix (chunked prefill) gives the one-shot logits."""
    runner = TinyRunner(tiny_llama_dir)
    a, b = _tokenize(tiny_llama_dir)
    full = runner.prefill([a, b], all_logits=True)  # [len(a) + len(b), vocab]
    runner.prefill([a[:2], b[:5]])
    rest = runner.extend([a[2:], b[5:]], all_logits=True)
    expected = torch.cat([full[2 : len(a)], full[len(a) + 5 :]])
    assert rel_err(rest, expected) < 1e-5
    # Last-token logits (the default rows) are the last row of each request.
    runner.prefill([a[:3], b[:1]])
    last = runner.extend([a[3:], b[1:]])
    assert rel_err(last, full[[len(a) - 1, len(a) + len(b) - 1]]) < 1e-5
    runner.release()
    assert runner.allocator.available_size() == runner.allocator.size


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(arch: str, request: pytest.FixtureRequest, tmp_path) -> None:
    """A tiny model exported to GGUF loads as transformers loads it (Q8_0), and an F32
    export reproduces the original HF model exactly (so the Q/K un-permutation is right)."""
    from transformers import AutoModelForCausalLM

    from sglang.test.fixtures import build_tiny_gguf

    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    tokens = _tokenize(folder)[1]
    for qtype, reference in (("Q8_0", None), ("F32", _hf_from_folder(folder))):
        path = build_tiny_gguf(folder, str(tmp_path / f"{arch}-{qtype}.gguf"), qtype)
        if reference is None:
            reference = AutoModelForCausalLM.from_pretrained(
                str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
        with torch.no_grad():
            ref = reference(torch.tensor([tokens])).logits[0]
        ours = TinyRunner(path).prefill([tokens], all_logits=True)
        assert rel_err(ours, ref) < 1e-5, qtype


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_tokens(smollm2_path: str) -> List[List[int]]:
    from sglang.srt.model_loader.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    return [tok(p).input_ids for p in PROMPTS]


def test_smollm2_gguf_matches_transformers(smollm2_path, smollm2_hf, smollm2_tokens) -> None:
    check_against_hf(TinyRunner(smollm2_path, dtype="float32"), smollm2_hf, smollm2_tokens, n_new=16)


def test_smollm2_gguf_bfloat16_is_sane(smollm2_path, smollm2_tokens) -> None:
    """bf16 (the GGUF default) drifts from float32 a little but still answers."""
    from sglang.srt.model_loader.loader import load_tokenizer

    runner = TinyRunner(smollm2_path, dtype="auto")
    assert runner.dtype == torch.bfloat16
    out = runner.generate_greedy([smollm2_tokens[0]], 6)[0]
    assert load_tokenizer(smollm2_path).decode(out).strip().startswith("Paris")
