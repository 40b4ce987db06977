"""Tensor parallelism at the model: two real torch.distributed processes (gloo on CPU, one
thread each) hold half the heads, half the FFN and half the vocabulary each, and their
logits and greedy tokens equal the one-process model's (float32) on tiny random Llama,
Qwen2 (q/k/v bias, tied embeddings), Mistral (explicit head_dim), a GQA model with fewer
KV heads than ranks (each rank keeps one, replicated), and the MoE models Mixtral,
Qwen2-MoE (shared expert, dense layers), Qwen3-MoE (q/k norms) and DeepSeek-V2 / V3 (MLA
heads split, the latent whole; grouped routing, shared experts) with every expert split
(EP 1) or half the experts whole on each rank (EP 2). The pools are free afterwards."""

from __future__ import annotations

import functools
from typing import List

import pytest
import torch

from sglang.test.tp_harness import dense_checks, greedy_run, run_ranks

pytestmark = pytest.mark.slow  # spawns torch.distributed processes

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9591, 2337, 253, 655, 28, 281, 253, 1991]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir, tmp_path_factory) -> List[str]:
    from sglang.test.fixtures import build_tiny_model

    one_kv = build_tiny_model("llama", str(tmp_path_factory.mktemp("tp") / "one_kv_head"),
                              seed=3, num_key_value_heads=1)
    return [tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir, one_kv]


def test_tp2_equals_tp1_on_dense_models(folders):
    torch.set_num_threads(1)
    reference = {f: greedy_run(f, PROMPTS, NEW_TOKENS) for f in folders}
    for rank, got in enumerate(run_ranks(functools.partial(dense_checks, folders, PROMPTS, NEW_TOKENS))):
        assert got["vocab_err"] < 1e-5
        for f in folders:
            ours, ref = got[f], reference[f]
            err = ((ours["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
            assert err < 1e-5, (f, rank, err)
            assert ours["tokens"] == ref["tokens"], (f, rank)
            assert ours["free"], (f, rank)


@pytest.fixture(scope="module")
def moe_folders(tiny_moe_dir) -> List[str]:
    return [tiny_moe_dir(arch) for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2",
                                            "deepseek_v3")]


@pytest.mark.parametrize("ep_size", [1, 2])
def test_tp2_equals_tp1_on_moe_models(moe_folders, ep_size):
    torch.set_num_threads(1)
    reference = {f: greedy_run(f, PROMPTS, NEW_TOKENS) for f in moe_folders}
    job = functools.partial(dense_checks, moe_folders, PROMPTS, NEW_TOKENS)
    for rank, got in enumerate(run_ranks(job, ep_size=ep_size)):
        for f in moe_folders:
            ours, ref = got[f], reference[f]
            err = ((ours["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
            assert err < 1e-5, (f, rank, ep_size, err)
            assert ours["tokens"] == ref["tokens"], (f, rank, ep_size)
            assert ours["free"], (f, rank)
