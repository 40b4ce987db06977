"""MLA on --attention-backend triton: the latent pool through sgl_kernel's attention kernels
gives torch_native's logits and greedy tokens (prefill, decode, a verify tree).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the
process first imports triton), so the model is the tiny DeepSeek-V3."""

from __future__ import annotations


import pytest
import torch

from sglang.test.triton_env import interpret_triton_without_a_gpu

interpret_triton_without_a_gpu()

from sglang.srt.layers.attention.base import create_attention_backend  # noqa: E402
from sglang.srt.mem_cache.mla_pool import create_kv_pool  # noqa: E402
from sglang.test.harness import TinyRunner  # noqa: E402
from sglang.test.scheduler_driver import greedy, make_scheduler, run  # noqa: E402


def test_mla_triton_matches_torch_native(tiny_moe_dir, moe_prompts) -> None:
    folder = tiny_moe_dir("deepseek_v3")
    prompts = [p[:8] for p in moe_prompts]
    runner = TinyRunner(folder, dtype="float32", kv_slots=512)
    runner.kv_pool = create_kv_pool(runner.config, 512, runner.dtype)
    ref_logits = runner.prefill(prompts, all_logits=True)
    runner.release()
    ref_tokens = runner.generate_greedy(prompts, 4)
    runner.backend = create_attention_backend("triton")
    logits = runner.prefill(prompts, all_logits=True)
    runner.release()
    assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-5
    assert runner.generate_greedy(prompts, 4) == ref_tokens


def test_mla_triton_ngram_trees_are_lossless(tiny_moe_dir) -> None:
    folder = tiny_moe_dir("deepseek_v2")
    prompts = [[7, 8, 9, 10] * 3, [300, 301, 302] * 3]
    plain = run(make_scheduler(folder), prompts, [greedy(6)] * 2)
    sched = make_scheduler(folder, attention_backend="triton", speculative_algorithm="NGRAM",
                           speculative_num_steps=2, speculative_num_draft_tokens=4)
    got = run(sched, prompts, [greedy(6)] * 2)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    sched.check_all_free()
