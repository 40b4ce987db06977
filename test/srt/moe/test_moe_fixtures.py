"""The fixture builders of scripts/build_moe_fixtures.py on tiny dense models: upcycled
identical experts reproduce the dense logits; a MoEfied model with every expert active
computes the dense MLP; a fitted router routes better than chance."""

from __future__ import annotations


import pytest
import torch

from sglang.test.fixtures import load_script
from sglang.test.harness import TinyRunner



@pytest.fixture(scope="module")
def builder():
    return load_script("build_moe_fixtures")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


TOKENS = [1, 450, 3200, 310, 4000, 12, 99, 1234, 5678, 42, 77, 300, 9, 10, 11]


def test_upcycled_identical_experts_equal_dense(builder, tiny_llama_dir, tmp_path) -> None:
    dense = TinyRunner(tiny_llama_dir)
    ref = dense.prefill([TOKENS], all_logits=True)
    state = builder.dense_state(dense.model)
    path = builder.upcycle_to_mixtral(state, dense.config, str(tmp_path / "up"), num_experts=4,
                                      top_k=2, router_std=0.5, dtype=torch.float32)
    moe = TinyRunner(path)
    assert type(moe.model).__name__ == "MixtralForCausalLM"
    assert rel_err(moe.prefill([TOKENS], all_logits=True), ref) < 1e-5
    noisy = builder.upcycle_to_mixtral(state, dense.config, str(tmp_path / "noisy"), num_experts=4,
                                       top_k=2, noise=0.05, dtype=torch.float32)
    err = rel_err(TinyRunner(noisy).prefill([TOKENS], all_logits=True), ref)
    assert 1e-4 < err < 0.5  # distinct experts, still the same model family


def test_moefied_all_experts_equal_dense_and_router_beats_chance(builder, tiny_qwen2_dir, tmp_path) -> None:
    dense = TinyRunner(tiny_qwen2_dir)
    ref = dense.prefill([TOKENS], all_logits=True)
    dense.release()
    calib = builder.mlp_inputs(dense, [TOKENS, TOKENS[::-1] * 2], max_tokens=1000)
    state = builder.dense_state(dense.model)
    # Every expert active with a zero router: uniform 1/E weights x E-scaled down_proj.
    path, _ = builder.moefy_to_qwen2_moe(state, dense.config, calib, str(tmp_path / "all"),
                                         num_experts=4, top_k=4, router_spread=0.0,
                                         dtype=torch.float32)
    moe = TinyRunner(path)
    assert type(moe.model).__name__ == "Qwen2MoeForCausalLM"
    assert rel_err(moe.prefill([TOKENS], all_logits=True), ref) < 1e-5
    # A fitted router, top-2 of 4: routes better than chance on its calibration tokens.
    path, summary = builder.moefy_to_qwen2_moe(state, dense.config, calib, str(tmp_path / "k2"),
                                               num_experts=4, top_k=2, dtype=torch.float32)
    assert summary["router_recall"] > 0.5 + 0.05
    logits = TinyRunner(path).prefill([TOKENS], all_logits=True)
    assert torch.isfinite(logits).all() and rel_err(logits, ref) < 1.0
