"""KV pool sizing: on CPU a share of the free RAM; on CUDA upstream's rule, a share of the
device's memory for weights + KV measured after the weights are loaded."""

import pytest

from sglang.srt.model_executor.model_runner import (CPU_KV_FRACTION, GPU_STATIC_FRACTION,
                                                    kv_pool_bytes)

GIB = 1 << 30


def test_cpu_pool_is_a_share_of_free_ram() -> None:
    assert kv_pool_bytes("cpu", None, 20 * GIB, 0) == int(20 * GIB * CPU_KV_FRACTION)
    assert kv_pool_bytes("cpu", 0.5, 20 * GIB, 0) == 10 * GIB


def test_gpu_pool_is_what_the_static_fraction_leaves_after_the_weights() -> None:
    """An H200 (139 GiB) with 16 GiB of weights loaded: at 0.85 the pool gets what is free
    less the 15% kept back, not a share of the host's RAM (which asked CUDA for hundreds
    of GB on a node with much RAM)."""
    total, free = 139 * GIB, 123 * GIB
    got = kv_pool_bytes("cuda", None, free, total)
    assert got == int(free - total * (1 - GPU_STATIC_FRACTION))
    assert 100 * GIB < got < free
    assert kv_pool_bytes("cuda:1", 0.9, free, total) > got  # a bigger share, a bigger pool


def test_gpu_without_room_for_kv_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="--mem-fraction-static.*--moe-expert-cache-slots"):
        kv_pool_bytes("cuda", 0.85, 10 * GIB, 80 * GIB)  # weights took 70 of 80 GiB
