"""The Triton fused-MoE kernel against its torch reference, and the reference against the
engine's CPU experts. On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1,
small shapes); on a GPU it runs compiled."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "sgl-kernel"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's import

from sgl_kernel.moe import fused_moe_reference, moe_align_block_size  # noqa: E402


def _case(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g).softmax(-1)
    return [x.to(DEVICE) for x in (hidden, w13, w2, weights, ids)]


def test_align_block_size_covers_every_pair_once() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]])
    sorted_ids, block_experts, total = moe_align_block_size(ids, 4, num_experts=5)
    real = sorted_ids[sorted_ids < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    assert total % 4 == 0 and block_experts.numel() == total // 4
    for b, e in enumerate(block_experts.tolist()):  # each block holds pairs of its expert only
        pairs = sorted_ids[b * 4 : (b + 1) * 4]
        pairs = pairs[pairs < ids.numel()]
        assert all(int(ids.view(-1)[p]) == e for p in pairs)


def test_static_alignment_has_the_pairs_of_the_exact_one_and_no_host_sync() -> None:
    """The sync-free layout holds each expert's pairs in the same order as the exact one,
    its extra blocks are expert -1, and it runs on the meta device (no host read)."""
    from sgl_kernel.moe import moe_align_block_size_static

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 6, (13, 2), generator=g)
    ids[3, 1] = ids[8, 0] = -1  # pairs held elsewhere
    exact, exact_experts, total = moe_align_block_size(ids, 4, num_experts=6)
    got, experts = moe_align_block_size_static(ids, 4, num_experts=6)
    assert got.numel() % 4 == 0 and experts.numel() == got.numel() // 4
    assert torch.equal(got[:total], exact) and torch.equal(experts[: total // 4], exact_experts)
    assert (got[total:] == ids.numel()).all() and (experts[total // 4:] == -1).all()
    meta_sorted, meta_experts = moe_align_block_size_static(ids.to("meta"), 4, num_experts=6)
    assert meta_sorted.shape == got.shape and meta_experts.shape == experts.shape


@pytest.mark.parametrize("t,h,inter,e,k", [(5, 32, 48, 4, 2), (19, 64, 32, 8, 3), (1, 32, 16, 6, 1)])
def test_triton_fused_moe_matches_reference(t, h, inter, e, k) -> None:
    pytest.importorskip("triton")
    from sgl_kernel.moe import fused_moe

    hidden, w13, w2, weights, ids = _case(t, h, inter, e, k, torch.float32)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    out = fused_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_pairs_of_experts_held_elsewhere_are_left_out() -> None:
    """Id -1 (an expert another rank holds, or outside this wave) adds nothing; calls over
    disjoint subsets of the pairs fill the same rows, bit for bit, as one call over all
    (waves of resident experts must not change a token)."""
    pytest.importorskip("triton")
    from sgl_kernel.moe import fused_moe, fused_moe_pairs

    hidden, w13, w2, weights, ids = _case(9, 32, 24, 6, 2, torch.float32, seed=4)
    held = ids.masked_fill(ids >= 3, -1)
    torch.testing.assert_close(fused_moe(hidden, w13, w2, weights, held),
                               fused_moe_reference(hidden, w13, w2, weights, held),
                               rtol=1e-4, atol=1e-4)
    whole = torch.zeros((ids.numel(), 32), device=DEVICE)
    fused_moe_pairs(hidden, w13, w2, weights, ids, whole)
    waves = torch.zeros_like(whole)
    for wave in ((0, 4), (1, 2, 5), (3,)):
        inside = torch.isin(ids, torch.tensor(wave, device=DEVICE))
        fused_moe_pairs(hidden, w13, w2, weights, ids.masked_fill(~inside, -1), waves)
    assert torch.equal(waves, whole)


@pytest.mark.parametrize("slots", [None, 2], ids=["resident", "store-2-slots"])
def test_the_moe_layer_runs_the_fused_kernel(tmp_path, slots) -> None:
    """--moe-runner-backend triton through the whole engine (Scheduler, tiny Mixtral, every
    expert resident or 2 of 8 in the store): the greedy tokens of the CPU path (float32)."""
    pytest.importorskip("triton")
    from sglang.test.moe_fixtures import build_tiny_moe
    from sglang.test.scheduler_driver import greedy, make_scheduler, run

    folder = build_tiny_moe("mixtral", str(tmp_path / "mixtral"))
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9591, 2337, 253, 655, 28, 281]]
    kw = {} if slots is None else {"moe_expert_cache_slots": slots}
    want = run(make_scheduler(folder, **kw), prompts, [greedy(8)] * 2)
    sched = make_scheduler(folder, moe_runner_backend="triton", **kw)
    assert {b.experts.runner for b in sched.runner.model.moe_blocks().values()} == {"triton"}
    got = run(sched, prompts, [greedy(8)] * 2)
    assert {r: ids for r, (ids, _) in got.items()} == {r: ids for r, (ids, _) in want.items()}
    sched.check_all_free()
    if slots:
        assert sched.runner.expert_store.stats().total().loads > 0
        sched.runner.expert_store.close()


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter mishandles bfloat16 storage")
def test_triton_fused_moe_bf16_on_gpu() -> None:
    from sgl_kernel.moe import fused_moe

    hidden, w13, w2, weights, ids = _case(33, 128, 96, 8, 2, torch.bfloat16)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(hidden, w13, w2, weights, ids), ref, rtol=2e-2, atol=2e-2)


def test_reference_matches_engine_experts() -> None:
    """The engine's CPU path (sorted dispatch, fixed-order combine) agrees with the reference."""
    from sglang.srt.layers.moe.experts import combine, experts_forward_into

    hidden, w13, w2, weights, ids = [x.cpu() for x in _case(7, 32, 24, 5, 2, torch.float32, seed=3)]
    out = hidden.new_empty((7, 2, 32))
    experts_forward_into(hidden, w13, w2, ids, out)
    torch.testing.assert_close(combine(out, weights, hidden.dtype),
                               fused_moe_reference(hidden, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
