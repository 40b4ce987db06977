"""torch_native attention: the grouped-query fold used for decode and verify rows gives
SDPA's own grouped-query result, with and without a (tree) mask."""

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.torch_native_backend import _folded_gqa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ext,masked", [(1, False), (5, True), (9, True)])
def test_folded_gqa_equals_sdpa_enable_gqa(dtype, ext, masked):
    g = torch.Generator().manual_seed(ext)
    heads, kv_heads, hd, kv_len = 12, 2, 16, 40
    q = torch.randn(heads, ext, hd, generator=g).to(dtype)
    # K/V as the backend reads them: a strided view of a [slots, kv_heads, hd] pool
    pool_k = torch.randn(kv_len + 3, kv_heads, hd, generator=g).to(dtype)
    pool_v = torch.randn(kv_len + 3, kv_heads, hd, generator=g).to(dtype)
    k, v = pool_k[3:].transpose(0, 1), pool_v[3:].transpose(0, 1)
    mask = None
    if masked:  # a tree mask: each row sees the prefix and a random subset of the tree
        mask = torch.ones(ext, kv_len, dtype=torch.bool)
        mask[:, kv_len - ext:] = torch.rand(ext, ext, generator=g) < 0.5
        mask[:, kv_len - ext:] |= torch.eye(ext, dtype=torch.bool)
    ref = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, scale=0.3, enable_gqa=True)[0]
    got = _folded_gqa(q, k, v, mask, 0.3)  # [ext, H, hd]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.transpose(0, 1).float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ext,masked", [(1, False), (4, True)])
def test_runs_path_equals_gather(dtype, ext, masked):
    """KV in a few runs of the pool (cached document, question, tree) attended run by run
    and merged by log-sum-exp equals attention over the gathered KV, including rows that
    see nothing in some run."""
    from sglang.srt.layers.attention.torch_native_backend import _folded_gqa_runs, _runs

    g = torch.Generator().manual_seed(7 + ext)
    heads, kv_heads, hd = 8, 2, 16
    k_buf = torch.randn(200, kv_heads, hd, generator=g).to(dtype)
    v_buf = torch.randn(200, kv_heads, hd, generator=g).to(dtype)
    idx = torch.cat([torch.arange(10, 60), torch.arange(100, 103), torch.arange(150, 150 + ext)])
    runs = _runs(idx)
    assert runs == [slice(10, 60), slice(100, 103), slice(150, 150 + ext)]
    kv_len = idx.numel()
    mask = None
    if masked:  # rows see the document, not the middle run, and their tree ancestors
        mask = torch.ones(ext, kv_len, dtype=torch.bool)
        mask[:, 50:53] = False
        mask[:, 53:] = torch.tril(torch.ones(ext, ext, dtype=torch.bool))
    q = torch.randn(heads, ext, hd, generator=g).to(dtype)
    ref = _folded_gqa(q, k_buf[idx].transpose(0, 1), v_buf[idx].transpose(0, 1), mask, 0.25)
    got = _folded_gqa_runs(q, k_buf, v_buf, runs, mask, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    assert _runs(torch.arange(0, 40, 2)) is None  # too fragmented: gather
