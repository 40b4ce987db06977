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
