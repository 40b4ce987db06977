"""sgl_kernel.cpu.decode_attention against a float64 softmax reference.

What the attention backend relies on: the result for any slot order, run layout and mask;
grouped-query heads; rows that see nothing give zeros; a row's result does not depend on
the other rows of the call (a verify row equals the decode row with the same keys) nor on
keys past the ones it may see (masked keys add exactly nothing); bad slot indices raise.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from sgl_kernel import cpu


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.is_available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def reference(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, idx: torch.Tensor,
              mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    k, v = kb[idx].double(), vb[idx].double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(s, -1), v)


# bf16 q, K and V with head dims that are multiples of 32 take the AMX path on CPUs with AMX
# (attention_isa() "avx512bf16"), other bf16 shapes the VDPBF16PS one; fp32 the AVX2 one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys,kvh,g,hd,rows", [
    (1, 1, 1, 8, 1), (37, 1, 1, 8, 3), (129, 2, 6, 128, 1), (700, 3, 3, 64, 5),
    (2100, 2, 7, 64, 1), (300, 4, 1, 16, 16), (517, 2, 6, 128, 7), (200, 1, 20, 32, 3),
])
@pytest.mark.parametrize("order", ["shuffled", "runs"])
def test_matches_reference(dtype: torch.dtype, keys: int, kvh: int, g: int, hd: int, rows: int,
                           order: str, seed: int) -> None:
    pool = keys + 50
    kb, vb = torch.randn(pool, kvh, hd).to(dtype), torch.randn(pool, kvh, hd).to(dtype)
    q = torch.randn(rows, kvh * g, hd).to(dtype)
    # any order: a draft's view, a tree; or consecutive runs (a cached document, a
    # question), which the AMX path loads from the pool without a copy
    idx = torch.randperm(pool)[:keys] if order == "shuffled" else torch.arange(keys) + 7
    mask = None
    if rows > 1:
        mask = torch.rand(rows, keys) < 0.6
        mask[:, 0] = True
    out = cpu.decode_attention(q, kb, vb, idx, mask, hd**-0.5)
    ref = reference(q, kb, vb, idx, mask, hd**-0.5)
    assert out.shape == (rows, kvh * g, hd) and out.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"seed {seed}: max error {err:.2e}"


@pytest.mark.parametrize("dtype,hd", [(torch.float32, 64), (torch.bfloat16, 64),
                                      (torch.bfloat16, 128), (torch.bfloat16, 16)])
@pytest.mark.parametrize("keys", [1000, 1024 + 16])
def test_row_independent_of_batch_and_masked_tail(dtype: torch.dtype, hd: int, keys: int,
                                                  seed: int) -> None:
    """A verify row (masked, other rows beside it, tree keys after its own) gives exactly
    the decode row's result over the same keys: speculative greedy output relies on it.
    Keys: the verify's tree tokens fall inside the decode row's last chunk, or past it."""
    kvh, g, extra, rows = 2, 6, 7, 6  # 36 query rows per KV head: more than two 16-row tiles
    kb = torch.randn(keys + extra, kvh, hd).to(dtype)
    vb = torch.randn(keys + extra, kvh, hd).to(dtype)
    q = torch.randn(rows, kvh * g, hd).to(dtype)
    idx = torch.arange(keys + extra)
    idx[100:300] = idx[100:300].flip(0)  # a run of slots out of order among consecutive ones
    alone = cpu.decode_attention(q[4:5], kb, vb, idx[:keys], None, 0.125)
    mask = torch.ones(rows, keys + extra, dtype=torch.bool)
    mask[4, keys:] = False  # row 4 must not see the tree's other tokens
    together = cpu.decode_attention(q, kb, vb, idx, mask, 0.125)
    assert torch.equal(together[4], alone[0]), f"seed {seed}"


def test_row_that_sees_nothing_is_zero_and_bad_index_raises() -> None:
    kb = torch.randn(10, 1, 8)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 3] = True
    out = cpu.decode_attention(torch.randn(2, 2, 8), kb, kb, torch.arange(10), mask, 1.0)
    assert torch.equal(out[0, 0], kb[3, 0]) and torch.equal(out[1], torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.decode_attention(torch.randn(1, 1, 8), kb, kb, torch.tensor([3, 10]), None, 1.0)
