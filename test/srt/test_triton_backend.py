"""--attention-backend triton matches torch_native: layer by layer on synthetic batches, and
greedy engine output token for token (plain, n-gram tree verification, a standalone draft).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the
first `import triton` of the process); everything is tiny because the interpreter is slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from sglang.srt.layers.attention.base import create_attention_backend  # noqa: E402
from sglang.srt.layers.attention.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative.tree import DraftTree  # noqa: E402
from sglang.test.scheduler_driver import greedy, make_scheduler, run  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _batch(g, reqs, mode, pool, table):
    """reqs: (prefix_len, ext, custom mask or None, kv override or None) per request."""
    seq_lens, ext, masks, overrides, out_loc = [], [], [], [], []
    next_slot = 1
    for row, (prefix, n, mask, override) in enumerate(reqs):
        slots = torch.arange(next_slot, next_slot + prefix + n)
        next_slot += prefix + n
        table.write(row, 0, slots)
        out_loc.append(slots[prefix:])
        kv_len = prefix + n if override is None else len(override) + n
        if override is not None:
            override = torch.cat([override, slots[prefix:]])
        seq_lens.append(kv_len)
        ext.append(n)
        masks.append(mask)
        overrides.append(override)
    # The prefix KV exists already: random K/V in every slot the batch does not write.
    for layer in range(pool.num_layers):
        pool.k_buffer[layer].normal_(generator=g)
        pool.v_buffer[layer].normal_(generator=g)
    total = sum(ext)
    return ForwardBatch(
        forward_mode=mode, batch_size=len(reqs),
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64),
        req_pool_indices=torch.arange(len(reqs)), seq_lens=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(ext), out_cache_loc=torch.cat(out_loc),
        req_to_token_pool=table, token_to_kv_pool=pool, attn_backend=None,
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext,
        custom_mask=masks if any(m is not None for m in masks) else None,
        kv_indices=overrides if any(o is not None for o in overrides) else None)


def _on_device(fb):
    """The same batch with its pool, table and tensors on DEVICE (a GPU when there is one;
    torch_native, the reference, stays on the CPU)."""
    if DEVICE == "cpu":
        return fb
    src = fb.token_to_kv_pool
    pool = KVPool(src.size, src.num_layers, src.num_kv_heads, src.head_dim, src.dtype, DEVICE)
    for dst_buf, src_buf in zip(pool.k_buffer + pool.v_buffer, src.k_buffer + src.v_buffer):
        dst_buf.copy_(src_buf)
    table = ReqToTokenPool(fb.req_to_token_pool.size, fb.req_to_token_pool.max_context_len, DEVICE)
    table.req_to_token.copy_(fb.req_to_token_pool.req_to_token)
    moved = {f: getattr(fb, f).to(DEVICE) for f in ("input_ids", "positions", "req_pool_indices",
                                                    "seq_lens", "extend_seq_lens", "out_cache_loc")}
    return dataclasses.replace(fb, token_to_kv_pool=pool, req_to_token_pool=table, **moved)


def _compare(fb, g) -> None:
    layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer_id=0)
    t = fb.num_tokens
    q = torch.randn(t, HEADS * HEAD_DIM, generator=g)
    k = torch.randn(t, KV_HEADS * HEAD_DIM, generator=g)
    v = torch.randn(t, KV_HEADS * HEAD_DIM, generator=g)
    outs = []
    for name, batch in (("torch_native", fb), ("triton", _on_device(fb))):
        backend = create_attention_backend(name)
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        dev = batch.token_to_kv_pool.k_buffer[0].device
        outs.append(backend.forward(q.to(dev), k.to(dev), v.to(dev), layer, batch).cpu())
        fb.attn_backend = backend
    err = (outs[0] - outs[1]).abs().max() / outs[0].abs().max()
    assert err <= 1e-4, f"normwise error {float(err):.2e} (seed {g.initial_seed()})"


@pytest.fixture
def setup():
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    pool = KVPool(400, 1, KV_HEADS, HEAD_DIM, torch.float32)
    return g, pool, ReqToTokenPool(6, 128)


def test_mixed_batch_with_tree_and_compressed_view(setup) -> None:
    g, pool, table = setup
    tree = DraftTree.root_only(5)
    for parent in (0, 0, 1, 1, 2):  # two branches from the root, each branching again
        tree.add(7, parent, -1.0)
    view = torch.tensor([1, 2, 3, 30, 31, 32, 33])  # sinks + window of a 34-token prefix
    reqs = [
        (10, 5, None, None),  # a prefill chunk after a cached prefix
        (20, 1, None, None),  # a decode
        (8, len(tree), tree.attention_mask(8), None),  # tree verification
        (34, 1, None, view),  # the draft reading a compressed view
        (0, 6, None, None),  # a fresh prompt
    ]
    _compare(_batch(g, reqs, ForwardMode.TARGET_VERIFY, pool, table), g)


def test_decode_batch_uses_split_kernel(setup) -> None:
    g, pool, table = setup
    reqs = [(0, 1, None, None), (70, 1, None, None), (5, 1, None, None)]
    fb = _batch(g, reqs, ForwardMode.DECODE, pool, table)
    _compare(fb, g)
    assert fb.attn_backend.meta.use_decode


# ---------------------------------------------------------------- engine, greedy
PROMPTS = [[5, 17, 99, 300, 17, 99, 300, 17, 99], [7, 8], list(range(100, 131))]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return run(make_scheduler(tiny_llama_dir), PROMPTS, [greedy(8)] * len(PROMPTS))


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU, scripts/gpu_check.sh runs the engine")
@pytest.mark.parametrize("spec", [
    {},
    {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 2,
     "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4},
], ids=["plain", "ngram", "standalone"])
def test_engine_greedy_equals_torch_native(tiny_llama_dir, reference, spec) -> None:
    if spec.get("speculative_algorithm") == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": tiny_llama_dir}
    sched = make_scheduler(tiny_llama_dir, attention_backend="triton", **spec)
    got = run(sched, PROMPTS, [greedy(8)] * len(PROMPTS))
    for rid, (ids, _) in reference.items():
        assert got[rid][0] == ids, f"request {rid}"
    sched.check_all_free()


def test_tree_masks_with_known_tails_pack_on_the_device(setup) -> None:
    """A verify's masks with their tails given (`custom_mask_tails`, as the batch builder
    and the draft's tree levels give them) pack without a host read of the masks and
    attend as the tails found on the host do."""
    from sglang.srt.utils import host_sync

    g, pool, table = setup
    tree = DraftTree.root_only(5)
    for parent in (0, 0, 1, 2):
        tree.add(7, parent, -1.0)
    reqs = [(12, len(tree), tree.attention_mask(12), None), (20, 1, None, None),
            (3, len(tree), tree.attention_mask(3), None)]
    fb = _batch(g, reqs, ForwardMode.TARGET_VERIFY, pool, table)
    _compare(fb, g)  # tails found on the host
    fb = dataclasses.replace(fb, custom_mask_tails=[len(tree), 0, len(tree)])
    backend = create_attention_backend("triton")
    fb.attn_backend = backend
    with host_sync.forbid_reads("packing masks of known tails"):
        backend.init_forward_metadata(_on_device(fb))
    assert backend.meta.mask_width.tolist() == [len(tree), 0, len(tree)]
    _compare(fb, g)
    with pytest.raises(RuntimeError, match="reads a device value"):  # the host's search reads
        with host_sync.forbid_reads("packing masks"):
            backend.init_forward_metadata(_on_device(dataclasses.replace(
                fb, custom_mask_tails=None)))
