"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 with MLA) against transformers on
tiny random checkpoints, through the real pools and the torch_native backend; MLA over the
latent pool with prefix reuse, tree masks and kv_indices overrides."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.mla_pool import MLATokenToKVPool, create_kv_pool
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang.test.harness import TinyRunner
from sglang.test.moe_fixtures import MOE_ARCHS


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def make_runner(folder: str, **load_kwargs) -> TinyRunner:
    runner = TinyRunner(folder, dtype="float32", kv_slots=2048)
    if load_kwargs:
        from sglang.srt.model_loader.loader import load_model

        runner.model, runner.config = load_model(folder, dtype="float32", **load_kwargs)
    runner.kv_pool = create_kv_pool(runner.config, 2048, runner.dtype)  # latent pool for MLA
    return runner


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_matches_transformers(arch, tiny_moe_dir, moe_prompts) -> None:
    folder = tiny_moe_dir(arch)
    runner, hf = make_runner(folder), hf_model(folder)
    if arch.startswith("deepseek"):
        assert isinstance(runner.kv_pool, MLATokenToKVPool)
    # Every position of one prompt (single request).
    with torch.no_grad():
        ref = hf(torch.tensor([moe_prompts[1]])).logits[0]
    ours = runner.prefill([moe_prompts[1]], all_logits=True)
    runner.release()
    assert rel_err(ours, ref) < 1e-3
    # A ragged batch: one EXTEND, then DECODE steps; greedy tokens equal HF's per prompt.
    n = 16
    batch = runner.generate_greedy(moe_prompts, n)
    for prompt, ours_tokens in zip(moe_prompts, batch):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        hf_tokens = out[0, len(prompt):].tolist()
        assert ours_tokens[: len(hf_tokens)] == hf_tokens
        assert len(set(ours_tokens)) > 1, "degenerate fixture: one repeated token"
    assert runner.allocator.available_size() == runner.allocator.size
    assert runner.req_pool.available_size() == runner.req_pool.size


def test_mla_pool_stores_only_the_latent(tiny_moe_dir) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_moe_dir("deepseek_v3"))
    pool = create_kv_pool(cfg, 16, torch.float32)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert pool.kv_buffer[0].shape == (17, 1, width)
    assert MLATokenToKVPool.bytes_per_token(cfg.num_hidden_layers, cfg.kv_lora_rank,
                                            cfg.qk_rope_head_dim, torch.float32) == \
        cfg.num_hidden_layers * width * 4
    lat = torch.randn(2, 1, width)
    pool.set_kv(1, torch.tensor([3, 4]), lat, None)
    k, v = pool.get_kv(1)
    assert torch.equal(k[3:5], lat) and torch.equal(v[3:5], lat[..., : cfg.kv_lora_rank])
    pool.move_kv(torch.tensor([3]), torch.tensor([7]))
    assert torch.equal(pool.kv_buffer[1][7], lat[0])


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_prefix_split_equals_one_shot(arch, tiny_moe_dir, moe_prompts) -> None:
    runner = make_runner(tiny_moe_dir(arch))
    a, b = moe_prompts
    full = runner.prefill([a, b], all_logits=True)
    runner.prefill([a[:3], b[:6]])
    rest = runner.extend([a[3:], b[6:]], all_logits=True)
    assert rel_err(rest, torch.cat([full[3 : len(a)], full[len(a) + 6 :]])) < 1e-5
    runner.release()


def _tree_batch(runner: TinyRunner, tokens, positions, mask, reorder=None) -> torch.Tensor:
    """One TARGET_VERIFY forward of request 0 (its KV already holds runner.lens[0] tokens);
    `reorder(row slots) -> slots` builds a kv_indices override."""
    prefix = runner.lens[0]
    n = len(tokens)
    loc = runner.allocator.alloc(n)
    runner.req_pool.write(runner.rows[0], prefix, loc)
    row = runner.req_pool.req_to_token[runner.rows[0], : prefix + n]
    kv_override = reorder(row) if reorder is not None else None
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=1,
        input_ids=torch.tensor(tokens), positions=torch.tensor(positions),
        req_pool_indices=torch.tensor(runner.rows[:1]), seq_lens=torch.tensor([prefix + n]),
        extend_seq_lens=torch.tensor([n]), out_cache_loc=loc,
        req_to_token_pool=runner.req_pool, token_to_kv_pool=runner.kv_pool,
        attn_backend=runner.backend, seq_lens_cpu=[prefix + n], extend_seq_lens_cpu=[n],
        custom_mask=[mask], kv_indices=[kv_override] if kv_override is not None else None)
    runner.backend.init_forward_metadata(fb)
    with torch.inference_mode():
        logits = runner.model(fb.input_ids, fb.positions, fb)
    runner.allocator.free(loc)
    return logits


def test_mla_tree_mask_and_kv_indices(tiny_moe_dir, moe_prompts) -> None:
    """A draft tree (root r with children x, y) verified in one pass with a tree mask gives
    the logits of each path computed as a plain chain; a kv_indices override is honoured."""
    runner = make_runner(tiny_moe_dir("deepseek_v3"))
    prompt = moe_prompts[0]
    r, x, y = 500, 1200, 2300
    p = len(prompt)
    chain_x = runner.prefill([prompt + [r, x]], all_logits=True)[-2:]
    chain_y = runner.prefill([prompt + [r, y]], all_logits=True)[-1:]
    runner.prefill([prompt])
    mask = torch.zeros(3, p + 3, dtype=torch.bool)
    mask[:, :p] = True
    mask[0, p] = mask[1, p] = mask[2, p] = True  # everyone sees the root
    mask[1, p + 1] = True  # x sees itself
    mask[2, p + 2] = True  # y sees itself, not its sibling x
    tree = _tree_batch(runner, [r, x, y], [p, p + 1, p + 1], mask)
    assert rel_err(tree[:2], chain_x) < 1e-5
    assert rel_err(tree[2:], chain_y) < 1e-5
    # kv_indices: the same slots in another order give the same attention (keys carry their
    # rotary positions in the latent); the mask's columns follow the override's order.
    mask_flipped = torch.cat([mask[:, :p].flip(1), mask[:, p:]], dim=1)
    permuted = _tree_batch(runner, [r, x, y], [p, p + 1, p + 1], mask_flipped,
                           reorder=lambda row: torch.cat([row[:p].flip(0), row[p:]]))
    assert rel_err(permuted, tree) < 1e-5
    runner.release()
    assert runner.allocator.available_size() == runner.allocator.size
