"""The GPU slow tier's staging set: every expert arrives exactly, through a bounded number of
host buffers, however many loader threads share them (on CPU the copies are synchronous;
the same code issues CUDA copies and events on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang.srt.expert_offload.sources import SafetensorsExpertSource
from sglang.srt.expert_offload.staging import PinnedStagingSource
from sglang.srt.expert_offload.store import ExpertStore


def _mixtral_layer1(folder: str):
    from safetensors import safe_open

    keys = {(1, e): tuple(f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                          for w in ("w1", "w3", "w2")) for e in range(8)}
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        ref = {e: (torch.cat([f.get_tensor(keys[(1, e)][0]), f.get_tensor(keys[(1, e)][1])]),
                   f.get_tensor(keys[(1, e)][2])) for e in range(8)}
    return keys, ref


def test_experts_arrive_exactly_through_a_bounded_staging_set(tiny_moe_dir) -> None:
    keys, ref = _mixtral_layer1(tiny_moe_dir("mixtral"))
    s13, s2 = ref[0][0].shape, ref[0][1].shape
    src = PinnedStagingSource(SafetensorsExpertSource(tiny_moe_dir("mixtral"), keys),
                              {1: (s13, s2)}, ref[0][0].dtype, depth=2, pin=False)
    one = (ref[0][0].numel() + ref[0][1].numel()) * ref[0][0].element_size()
    assert src.staged_bytes() == 2 * one  # two experts of host memory for eight
    errors = []

    def loader(order):
        for e in order:
            w13, w2 = torch.full(s13, float("nan")), torch.full(s2, float("nan"))
            n = src.read_into(1, e, w13, w2)
            if not (torch.equal(w13, ref[e][0]) and torch.equal(w2, ref[e][1]) and n == one):
                errors.append(e)

    # three threads on two pairs: a thread waits for a free pair, never shares one
    threads = [threading.Thread(target=loader, args=(order * 20,))
               for order in ([0, 1, 2, 3], [7, 6, 5, 4], [3, 5, 1, 7])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert src._free.qsize() == 2  # every pair back
    src.close()


def test_a_store_over_the_staging_set_serves_every_expert(tiny_moe_dir) -> None:
    keys, ref = _mixtral_layer1(tiny_moe_dir("mixtral"))
    w13 = torch.empty((2, *ref[0][0].shape))
    w2 = torch.empty((2, *ref[0][1].shape))
    src = PinnedStagingSource(SafetensorsExpertSource(tiny_moe_dir("mixtral"), keys),
                              {1: (w13.shape[1:], w2.shape[1:])}, w13.dtype, pin=False)
    store = ExpertStore(src, {1: (w13, w2)}, {1: 8})
    for pair in ([0, 5], [2, 3], [7, 1], [5, 6]):
        store.prefetch(1, pair[1:])
        lease = store.acquire(1, pair)
        for e, slot in lease.slot_of.items():
            assert torch.equal(w13[slot], ref[e][0]) and torch.equal(w2[slot], ref[e][1])
        store.release(lease)
    store.wait_loads()
    store.check_idle()
    store.close()


def test_the_staging_set_needs_a_pair() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PinnedStagingSource(None, {1: (torch.Size([4, 2]), torch.Size([2, 2]))},
                            torch.float32, depth=0, pin=False)
