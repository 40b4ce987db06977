"""sgl_kernel.attention's Triton kernels against their torch references.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, tiny shapes: it pays
per program and per op); on a GPU they run compiled (scripts/gpu_check.sh). Inputs are
fresh random tensors every run; the seed is in every failure message. Errors are normwise
against the reference computed in float32 from the same (upcast) inputs:
max |out - ref| / max |ref| <= 1e-4 for float32 outputs, 1e-2 for bf16 outputs.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from typing import List, Optional

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:  # find_spec: triton must not be imported yet
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`
KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "sgl-kernel")
if importlib.util.find_spec("sgl_kernel") is None:
    sys.path.insert(0, KERNEL_DIR)

from sgl_kernel import attention as K  # noqa: E402
from sgl_kernel import reference as R  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh seed per test; failure messages quote it (gen.initial_seed())."""
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, g) -> None:
    assert torch.isfinite(out.float()).all(), f"non-finite output (seed {g.initial_seed()})"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    assert err <= TOL[dtype], f"normwise error {float(err):.2e} (seed {g.initial_seed()})"


def _pool(g, slots: int, kvh: int, d: int, dv: int, dtype):
    k = torch.randn(slots, kvh, d, generator=g).to(dtype)
    v = torch.randn(slots, kvh, dv, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def _slot_lists(g, lens: List[int], slots: int):
    """Distinct random slots per request (not sorted: lists are arbitrary views)."""
    idx = [torch.randperm(slots - 1, generator=g)[:n] + 1 for n in lens]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return indptr.to(DEVICE), torch.cat(idx).to(DEVICE)


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d,splits", [(4, 2, 16, 1), (4, 4, 20, 3), (8, 1, 32, 2)])
def test_decode_ragged_batch_with_empty_requests(gen, dtype, heads, kvh, d, splits) -> None:
    lens = [1, 0, 37, int(torch.randint(2, 50, (1,), generator=gen)), 0]
    k, v = _pool(gen, 160, kvh, d, d, dtype)
    indptr, idx = _slot_lists(gen, lens, 160)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = K.decode_attention(q, k, v, indptr, idx, scale, num_kv_splits=splits)
    ref = R.decode_attention_reference(q.float(), k.float(), v.float(), indptr, idx, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    _close(out, ref, dtype, gen)
    assert (out[1] == 0).all() and (out[4] == 0).all(), "an empty slot list must give zeros"


def test_decode_more_splits_than_tiles_and_mla_shapes(gen) -> None:
    """A latent (MLA) pool: one KV head, K = [c_kv | k_pe] (D = 48 + 16), V = a strided view
    of K's first 48 columns; more splits than the short lists have tiles."""
    latent = torch.randn(90, 1, 64, generator=gen).to(DEVICE)
    lens = [3, 70]
    indptr, idx = _slot_lists(gen, lens, 90)
    q = torch.randn(2, 16, 64, generator=gen).to(DEVICE)
    out = K.decode_attention(q, latent, latent[..., :48], indptr, idx, 0.1, num_kv_splits=8)
    ref = R.decode_attention_reference(q, latent, latent[..., :48], indptr, idx, 0.1)
    _close(out, ref, torch.float32, gen)


# ---------------------------------------------------------------- extend
def _extend_case(gen, ext: List[int], prefix: List[int], heads=4, kvh=2, d=16, dtype=torch.float32):
    kv_lens = [e + p for e, p in zip(ext, prefix)]
    k, v = _pool(gen, 200, kvh, d, d, dtype)
    kv_indptr, idx = _slot_lists(gen, kv_lens, 200)
    qo = torch.zeros(len(ext) + 1, dtype=torch.int64)
    qo[1:] = torch.tensor(ext).cumsum(0)
    q = torch.randn(sum(ext), heads, d, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, qo.to(DEVICE), kv_indptr, idx, kv_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_causal_ragged(gen, dtype) -> None:
    # Pure prefill, prefill after a cached prefix, a 1-token decode, an empty request, and a
    # chunk longer than one query tile.
    ext, prefix = [5, 3, 1, 0, 21], [0, 9, 30, 4, 6]
    q, k, v, qo, kv_indptr, idx, _ = _extend_case(gen, ext, prefix, dtype=dtype)
    out = K.extend_attention(q, k, v, qo, kv_indptr, idx, 0.25)
    ref = R.extend_attention_reference(q.float(), k.float(), v.float(), qo, kv_indptr, idx, 0.25)
    _close(out, ref, dtype, gen)


def _random_tree(gen, n: int) -> List[int]:
    """Parents of an n-node tree in topological order (several branches when n > 2)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_tree_verify_mask_from_tree_builder(gen, dtype) -> None:
    fixed = [-1, 0, 0, 1, 1, 2, 3, 3]  # root with two branches, each branching again
    trees = [fixed, _random_tree(gen, 6), [-1], _random_tree(gen, 19)]
    ext = [len(t) for t in trees]
    prefix = [12, 0, 7, 25]
    q, k, v, qo, kv_indptr, idx, kv_lens = _extend_case(gen, ext, prefix, dtype=dtype)
    parents = torch.tensor(sum(trees, []), dtype=torch.int64, device=DEVICE)
    flat, mask_indptr, width = K.build_tree_mask(parents, qo)
    out = K.extend_attention(q, k, v, qo, kv_indptr, idx, 0.3, flat, mask_indptr, width)
    full = [torch.cat([torch.ones(n, p, dtype=torch.bool), m], 1)
            for n, p, m in zip(ext, prefix, R.tree_mask_reference(trees))]
    ref = R.extend_attention_reference(q.float(), k.float(), v.float(), qo, kv_indptr, idx,
                                       0.3, full)
    _close(out, ref, dtype, gen)


def test_extend_general_masks_packed(gen) -> None:
    """Masks that hide prefix columns too (packed at full width), a draft-frontier shape
    (tail wider than the queries), a causal request in the same batch, an empty request,
    and a query row that sees nothing (zeros)."""
    ext, prefix = [4, 3, 6, 0], [10, 8, 5, 3]
    q, k, v, qo, kv_indptr, idx, kv_lens = _extend_case(gen, ext, prefix, heads=2, kvh=1, d=24)
    general = torch.rand(4, 14, generator=gen) > 0.4
    general[:, 0] = False  # the first column is hidden: the whole width is kept
    general[2] = False  # a row that sees nothing
    frontier = torch.cat([torch.ones(3, 6, dtype=torch.bool),
                          torch.rand(3, 5, generator=gen) > 0.5], 1)
    masks: List[Optional[torch.Tensor]] = [general, frontier, None, torch.zeros(0, 3, dtype=torch.bool)]
    flat, mask_indptr, width = K.pack_custom_masks(masks, ext, kv_lens, DEVICE)
    assert width.tolist()[0] == 14 and width.tolist()[2] == 0
    out = K.extend_attention(q, k, v, qo, kv_indptr, idx, 0.2, flat, mask_indptr, width)
    ref = R.extend_attention_reference(q, k, v, qo, kv_indptr, idx, 0.2, masks)
    _close(out, ref, torch.float32, gen)
    assert (out[2] == 0).all()


# ---------------------------------------------------------------- helpers
def test_tree_mask_builder_matches_reference(gen) -> None:
    trees = [[-1, 0, 0, 1, 1, 2, 3, 3], [-1], [], _random_tree(gen, 13), [-1, 0, 1, 2, 3]]
    sizes = [len(t) for t in trees]
    indptr = torch.zeros(len(trees) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(sizes).cumsum(0)
    parents = torch.tensor(sum(trees, []), dtype=torch.int32, device=DEVICE)
    flat, mask_indptr, width = K.build_tree_mask(parents, indptr.to(DEVICE))
    ref = R.tree_mask_reference(trees)
    assert width.tolist() == sizes
    for b, m in enumerate(ref):
        lo, hi = int(mask_indptr[b]), int(mask_indptr[b + 1])
        assert torch.equal(flat[lo:hi].cpu().bool().view(sizes[b], sizes[b]), m), trees[b]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_slots_compaction_is_sequential_and_bit_exact(gen, dtype) -> None:
    # Accepted path [0, 2, 3, 7] of an 8-node tree moved to the tree's first 4 slots: slot 2
    # is read for position 1 before position 2 is overwritten (sequential semantics).
    tree = torch.randperm(40, generator=gen)[:8] + 1
    keep = torch.tensor([0, 2, 3, 7])
    src, dst = tree[keep].to(DEVICE), tree[: len(keep)].to(DEVICE)
    bufs = [torch.randn(42, 2, 5, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    bufs.append(torch.randn(42, 1, 7, generator=gen).to(dtype).to(DEVICE))  # other row size
    want = [b.clone() for b in bufs]
    K.move_kv_slots(bufs, src, dst)
    R.move_kv_slots_reference(want, src, dst)
    for got, exp in zip(bufs, want):
        assert torch.equal(got, exp), f"seed {gen.initial_seed()}"


def test_gather_kv_indices_matches_table_rows(gen) -> None:
    table = torch.randint(1, 1000, (6, 300), generator=gen).to(DEVICE)
    rows = torch.tensor([4, 0, 5, 2]).to(DEVICE)
    lens = [7, 0, 260, 1]
    indptr = torch.zeros(5, dtype=torch.int64)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    got = K.gather_kv_indices(table, rows, indptr.to(DEVICE), sum(lens))
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), lens)])
    assert torch.equal(got, want)


# ---------------------------------------------------------------- GPU lowering, no GPU
@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the tests above compile the kernels")
@pytest.mark.parametrize("arch", [80, 90], ids=["ampere", "hopper"])
def test_kernels_compile_for_ampere_and_hopper(arch) -> None:
    """Each kernel (attention and fused MoE), with the launch configuration its launcher
    picks on a GPU, compiles for sm_80 (A100) and sm_90 (H100 / H200) with Triton's bundled
    ptxas and fits in shared memory (a process without the interpreter; compiled kernels
    are cached, so reruns are quick)."""
    triton_dir = importlib.util.find_spec("triton").submodule_search_locations[0]
    if not os.path.exists(os.path.join(triton_dir, "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([KERNEL_DIR, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "sgl_kernel.attention.compile_check",
                           "--arch", str(arch)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
