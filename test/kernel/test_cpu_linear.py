"""sgl_kernel.cpu.small_m_linear against the torch reference, and the routing in
sglang.srt.layers.linear.

Inputs are fresh random tensors every run (the seed is in each failure message). Errors are
normwise: max |y - ref| / max |ref| <= 1e-4 for fp32 outputs, 1e-2 for bf16 outputs.
Shapes are ragged on purpose: every M in 1..33, K not a multiple of 8 or 16, odd N.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from sgl_kernel import cpu
from sgl_kernel.reference import linear_reference

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# (x dtype, W dtype): same-dtype pairs as a model runs them, and the mixed ones.
PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("bf16", "f32")]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.is_available():
        pytest.skip(f"CPU linear kernel unavailable: {cpu.unavailable_reason()}")


def _check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype, f"{what}: {y.shape} {y.dtype}"
    tol = 1e-4 if ref.dtype == torch.float32 else 1e-2
    scale = ref.float().abs().max().clamp_min(1e-30)
    err = ((y.float() - ref.float()).abs().max() / scale).item()
    assert err <= tol, f"{what}: normwise error {err:.2e} > {tol:g}"


def _bias(n: int, kind: Optional[str]) -> Optional[torch.Tensor]:
    return None if kind is None else torch.randn(n).to(DTYPES[kind])


@pytest.mark.parametrize("xd,wd", PAIRS)
def test_matches_reference_ragged(xd: str, wd: str, seed: int) -> None:
    # K: below one vector, between 8 and 16 multiples, and a long odd one; N: 1 and odd.
    for k, n in [(7, 1), (77, 37), (1031, 131)]:
        w = torch.randn(n, k).to(DTYPES[wd])
        for m in range(1, 34):
            bias_kind = [None, "f32", "bf16"][m % 3]
            x = torch.randn(m, k).to(DTYPES[xd])
            b = _bias(n, bias_kind)
            _check(cpu.small_m_linear(x, w, b), linear_reference(x, w, b),
                   f"seed={seed} x={xd} w={wd} M={m} K={k} N={n} bias={bias_kind}")


@pytest.mark.parametrize("xd,wd", PAIRS)
def test_blocked_paths(xd: str, wd: str, seed: int) -> None:
    """K long enough to be split into k-blocks, N into several n-blocks per thread (with the
    next block prefetched), and M past the 4-row tiles and past 32 rows."""
    k, n = 4100, 601
    w = torch.randn(n, k).to(DTYPES[wd])
    b = torch.randn(n)
    for m in (1, 2, 5, 8, 19, 70):
        x = torch.randn(m, k).to(DTYPES[xd])
        _check(cpu.small_m_linear(x, w, b), linear_reference(x, w, b),
               f"seed={seed} x={xd} w={wd} M={m} K={k} N={n}")


@pytest.mark.parametrize("xd", ["f32", "bf16"])
def test_same_bits_for_any_thread_count(xd: str, seed: int) -> None:
    """Each output has one fixed summation order, however N is split across threads (bf16 x
    with bf16 W is the AVX512-BF16 kernel where the CPU has it)."""
    x, w = torch.randn(9, 1000).to(DTYPES[xd]), torch.randn(333, 1000).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.small_m_linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = cpu.small_m_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many), f"seed={seed}"


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_row_bits_do_not_depend_on_the_other_rows(dt: str, seed: int) -> None:
    """A verify pass of M draft tokens gives each row exactly what a 1-row decode of it gives
    (what keeps greedy speculation equal to plain decoding token for token): for fp32, up to
    the 6 rows one AVX2 sweep takes; for bf16 on AVX512-BF16, up to its 10."""
    isa = cpu.linear_isa()
    if dt == "bf16" and isa != "avx512bf16":
        pytest.skip("bf16 rows share AVX2 sweeps of different shapes (5-6 rows: two sums)")
    max_rows = 10 if dt == "bf16" else 6
    # K not a multiple of 32: the masked tail step too; K = 4870: a long K that one sweep
    # cuts into k-blocks (a down projection's), for every M alike
    for k, n in ((1000, 203), (4870, 97)):
        w, b = torch.randn(n, k).to(DTYPES[dt]), torch.randn(n).to(DTYPES[dt])
        for m in range(1, max_rows + 1):
            x = torch.randn(m, k).to(DTYPES[dt])
            y = cpu.small_m_linear(x, w, b)
            for i in range(m):
                assert torch.equal(y[i:i + 1], cpu.small_m_linear(x[i:i + 1], w, b)), (
                    f"seed={seed} {isa} M={m} row {i} K={k}")


def test_shapes_and_views(seed: int) -> None:
    w, b = torch.randn(45, 67).bfloat16(), torch.randn(45).bfloat16()
    x3 = torch.randn(2, 3, 67).bfloat16()  # leading dims are flattened and restored
    _check(cpu.small_m_linear(x3, w, b), linear_reference(x3, w, b), f"seed={seed} 3-d x")
    xt = torch.randn(67, 5).t()  # non-contiguous x
    _check(cpu.small_m_linear(xt, w), linear_reference(xt, w), f"seed={seed} x view")
    wt = torch.randn(67, 45).t()  # non-contiguous W
    _check(cpu.small_m_linear(xt, wt), linear_reference(xt, wt), f"seed={seed} W view")
    assert cpu.small_m_linear(torch.randn(0, 67), w).shape == (0, 45)
    empty_k = cpu.small_m_linear(torch.randn(3, 0), torch.randn(4, 0), torch.ones(4))
    assert torch.equal(empty_k, torch.ones(3, 4))


def test_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match="K of x and weight"):
        cpu.small_m_linear(torch.randn(2, 8), torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.small_m_linear(torch.randn(2, 8).half(), torch.randn(3, 8).half())


def test_layer_linear_routes_and_matches(seed: int) -> None:
    from sglang.srt.layers import linear as lin

    assert lin.cpu_kernel_available()
    for rows in (1, 8, 40, 200):  # kernel and torch paths for both weight dtypes
        for dtype in (torch.float32, torch.bfloat16):
            layer = lin.Linear(96, 50, bias=True).to(dtype)
            x = torch.randn(rows, 96).to(dtype)
            with torch.inference_mode():
                y = layer(x)
            _check(y, linear_reference(x, layer.weight, layer.bias),
                   f"seed={seed} rows={rows} {dtype}")
    # Autograd needs torch's op: the kernel has no backward.
    layer = lin.Linear(16, 4)
    y = layer(torch.randn(3, 16))
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert layer.weight.grad is not None


def test_build_failure_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or any build error): is_available() is False without raising, and
    layers.linear computes with torch."""
    import torch.utils.cpp_extension as cpp_extension

    from sglang.srt.layers import linear as lin

    def broken_load(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    assert not cpu.is_available()
    assert "no C++ compiler" in (cpu.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu.small_m_linear(torch.randn(2, 8), torch.randn(3, 8))

    monkeypatch.setattr(lin, "_kernel", None)
    monkeypatch.setattr(lin, "_checked", False)
    assert not lin.cpu_kernel_available()
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    assert torch.equal(lin.linear(x, w), torch.nn.functional.linear(x, w))
