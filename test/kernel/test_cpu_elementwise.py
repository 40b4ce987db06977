"""sgl_kernel.cpu rmsnorm / rotary_embedding / silu_and_mul against the torch expressions they
replace in the model layers (which follow Hugging Face's numerics).

What the layers rely on: rotary is bit-identical to torch's in float32 and bfloat16 (partial
rotary and strided rows included); RMSNorm's residual sum is exact and its output differs
only in the last bits (mean-of-squares summation order); silu * up likewise (exp); every row
is computed alone, so a verify row equals the decode row bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_kernel import cpu


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.is_available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def torch_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 hd: int) -> torch.Tensor:
    x = x.reshape(-1, heads, hd)
    rot = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    turned = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat((xr * c + turned * s, xp), dim=-1).reshape(-1, heads * hd)


def cos_sin(T: int, rot: int, dtype: torch.dtype):
    pos = torch.randint(0, 100_000, (T,)).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, dtype) -> None:
    g, w = got.double(), want.double()
    tol = ulps * ULP[dtype] * w.abs().clamp_min(1e-30) + 1e-30
    bad = (g - w).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} values off by more than {ulps} ulps"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 896), (3, 1539), (300, 64)])
def test_rmsnorm_matches_torch(dtype, rows, dim, seed):
    x = (torch.randn(rows, dim) * 3).to(dtype)
    r = torch.randn(rows, dim).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)
    # torch's own float mean of squares is off by an ulp or two; the products round after.
    # bf16 rounds twice (the normalised row, then times w): a 1-ulp flip of the first can
    # come out as 2 ulps of the result (seen once in ~20K values at seed 1360741716).
    ulps = 4 if dtype == torch.float32 else 2
    assert_within_ulps(cpu.rmsnorm(x, w, 1e-6), torch_rmsnorm(x, w, 1e-6), ulps, dtype)
    out, s = cpu.rmsnorm(x, w, 1e-6, residual=r)
    assert torch.equal(s, x + r), f"seed {seed}: the residual sum is torch's, exactly"
    assert_within_ulps(out, torch_rmsnorm(x + r, w, 1e-6), ulps, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,hd,rot", [(14, 64, 64), (2, 128, 128), (4, 64, 32), (3, 8, 8)])
def test_rotary_is_bit_identical_to_torch(dtype, heads, hd, rot, seed):
    T, kv = 7, 2
    # the q part of a fused qkv output: rows strided, as the attention layer hands it over
    qkv = torch.randn(T, (heads + 2 * kv) * hd).to(dtype)
    q = qkv[:, : heads * hd]
    cos, sin = cos_sin(T, rot, dtype)
    want = torch_rotary(q.clone(), cos, sin, heads, hd)
    rest = qkv[:, heads * hd:].clone()
    cpu.rotary_embedding(q, heads, hd, cos, sin)
    assert torch.equal(q, want), f"seed {seed}"
    assert torch.equal(qkv[:, heads * hd:], rest), "only q's columns change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(1, 4864), (6, 1536), (2, 13), (200, 64)])
def test_silu_and_mul_matches_torch(dtype, rows, d, seed):
    x = (torch.randn(rows, 2 * d) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # the exp's clamps
    want = F.silu(x[:, :d]) * x[:, d:]
    got = cpu.silu_and_mul(x)
    assert torch.isfinite(got).all()
    # a bf16 silu that rounds the other way moves the product by one bf16 ulp
    assert_within_ulps(got, want, 4 if dtype == torch.float32 else 1, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_computed_alone(dtype, seed):
    x = torch.randn(9, 512).to(dtype)
    r = torch.randn(9, 512).to(dtype)
    w = torch.rand(512).to(dtype)
    cos, sin = cos_sin(9, 64, dtype)
    batch_norm, _ = cpu.rmsnorm(x, w, 1e-5, residual=r)
    batch_act = cpu.silu_and_mul(x)
    batch_rot = x.clone()
    cpu.rotary_embedding(batch_rot, 8, 64, cos, sin)
    for i in range(9):
        one, _ = cpu.rmsnorm(x[i : i + 1], w, 1e-5, residual=r[i : i + 1])
        assert torch.equal(one[0], batch_norm[i]), f"seed {seed}: rmsnorm row {i}"
        assert torch.equal(cpu.silu_and_mul(x[i : i + 1])[0], batch_act[i])
        rot = x[i : i + 1].clone()
        cpu.rotary_embedding(rot, 8, 64, cos[i : i + 1], sin[i : i + 1])
        assert torch.equal(rot[0], batch_rot[i])


def test_bad_shapes_raise():
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu.rmsnorm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        cpu.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu.rotary_embedding(x, 2, 8, torch.randn(2, 10), torch.randn(2, 10))
