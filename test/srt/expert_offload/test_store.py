"""The expert store: fewer fast-tier slots than experts changes nothing in the output, slot
accounting returns to baseline, and no expert is evicted while a layer uses it."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from sglang.srt.expert_offload.sources import SafetensorsExpertSource
from sglang.srt.expert_offload.store import ExpertStore
from sglang.srt.model_loader.loader import load_model
from sglang.test.harness import TinyRunner
from sglang.srt.mem_cache.mla_pool import create_kv_pool


def runner_with_slots(folder: str, slots=None, drop_page_cache: bool = False) -> TinyRunner:
    runner = TinyRunner(folder, dtype="float32", kv_slots=2048)
    if slots is not None:
        runner.model, runner.config = load_model(folder, dtype="float32", moe_expert_cache_slots=slots,
                                                 moe_expert_drop_page_cache=drop_page_cache)
    runner.kv_pool = create_kv_pool(runner.config, 2048, runner.dtype)
    return runner


def assert_baseline(store: ExpertStore) -> None:
    store.check_idle()
    for layer in store.layers():
        states = store.slot_states(layer)
        assert states["pinned"] == 0 and states["loading"] == 0
        assert states["free"] + states["resident"] == store.num_slots


@pytest.mark.parametrize("arch,slots", [("mixtral", 1), ("mixtral", 3), ("deepseek_v3", 2)])
def test_fewer_slots_same_output(arch, slots, tiny_moe_dir, moe_prompts) -> None:
    folder = tiny_moe_dir(arch)
    full = runner_with_slots(folder)
    ref_logits = full.prefill(moe_prompts, all_logits=True)
    full.release()
    ref_tokens = full.generate_greedy(moe_prompts, 10)

    runner = runner_with_slots(folder, slots, drop_page_cache=(slots == 1))
    store = runner.model.expert_store
    assert store is not None and store.num_slots == slots
    assert all(tuple(b.experts.w13.shape[:1]) == (slots,) for b in runner.model.moe_blocks().values())
    assert torch.equal(runner.prefill(moe_prompts, all_logits=True), ref_logits)
    runner.release()
    assert runner.generate_greedy(moe_prompts, 10) == ref_tokens
    assert_baseline(store)
    total = store.stats().total()
    assert total.misses > 0 and total.loads == total.misses + total.prefetch_loads
    assert total.bytes_loaded > 0 and total.stall_seconds > 0
    store.close()


def test_all_slots_is_fully_resident(tiny_moe_dir, moe_prompts) -> None:
    runner = runner_with_slots(tiny_moe_dir("qwen2_moe"), slots=8)
    store = runner.model.expert_store
    assert all(store.resident(layer) == list(range(8)) for layer in store.layers())
    runner.generate_greedy(moe_prompts, 4)
    total = store.stats().total()
    assert total.misses == 0 and total.hits > 0 and total.hit_rate == 1.0
    store.close()


def _tiny_store(folder: str, slots: int):
    """A store over layer 1 of the tiny Mixtral with its own slot tensors."""
    from safetensors import safe_open

    keys = {(1, e): tuple(f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                          for w in ("w1", "w3", "w2")) for e in range(8)}
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        ref = {e: (torch.cat([f.get_tensor(keys[(1, e)][0]), f.get_tensor(keys[(1, e)][1])]),
                   f.get_tensor(keys[(1, e)][2])) for e in range(8)}
    w13 = torch.empty((slots, *ref[0][0].shape))
    w2 = torch.empty((slots, *ref[0][1].shape))
    store = ExpertStore(SafetensorsExpertSource(folder, keys), {1: (w13, w2)}, {1: 8})
    return store, ref


def test_pinned_experts_are_never_evicted(tiny_moe_dir) -> None:
    store, ref = _tiny_store(tiny_moe_dir("mixtral"), slots=2)
    lease = store.acquire(1, [0, 5])
    # Every slot is pinned: a prefetch must not take one.
    assert store.prefetch(1, [2, 3]) == 0
    assert store.resident(1) == [0, 5]
    w13, w2 = store.weights(1)
    for e, slot in lease.slot_of.items():
        assert torch.equal(w13[slot], ref[e][0]) and torch.equal(w2[slot], ref[e][1])
    store.release(lease)
    # Unpinned now: the least recently used one (0 and 5 share a tick; 0 was acquired with
    # 5, so touch 5 to make 0 the LRU) makes room for a prefetch.
    store.release(store.acquire(1, [5]))
    assert store.prefetch(1, [2]) == 1
    store.wait_loads()
    assert store.resident(1) == [2, 5]
    stats = store.stats().layers[1]
    assert stats.prefetch_loads == 1 and stats.evictions == 1 and stats.hits == 1
    lease = store.acquire(1, [2])  # a prefetched expert is a hit
    assert store.stats().layers[1].hits == 2
    store.release(lease)
    # Queue prefetches and use one at once: found still loading ("late") or taken over by
    # the caller, it is correct either way.
    store.prefetch(1, [6, 7])
    lease = store.acquire(1, [7])
    assert torch.equal(w13[lease.slot_of[7]], ref[7][0])
    store.release(lease)
    assert_baseline(store)
    with pytest.raises(ValueError):
        store.prefetch(1, [8])
    store.close()


def test_concurrent_prefetch_cannot_corrupt_running_layers(tiny_moe_dir, moe_prompts) -> None:
    """A thread prefetching random experts as fast as it can (evicting whatever is unpinned)
    while the model generates: outputs stay bit-identical to all-resident."""
    folder = tiny_moe_dir("mixtral")
    full = runner_with_slots(folder)
    ref_tokens = full.generate_greedy(moe_prompts, 8)
    runner = runner_with_slots(folder, slots=3)
    store = runner.model.expert_store
    stop = threading.Event()

    def hammer() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            store.prefetch(rng.choice(store.layers()), rng.sample(range(8), 3))

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        tokens = runner.generate_greedy(moe_prompts, 8)
    finally:
        stop.set()
        thread.join()
    assert tokens == ref_tokens
    assert store.stats().total().prefetch_loads > 0
    assert_baseline(store)
    store.close()


def test_server_args_validate_cache_slots() -> None:
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="moe-expert-cache-slots"):
        ServerArgs(model_path="x", moe_expert_cache_slots=0)
    with pytest.raises(ValueError, match="drop-page-cache"):
        ServerArgs(model_path="x", moe_expert_drop_page_cache=True)
    assert ServerArgs(model_path="x", moe_expert_cache_slots=4).moe_expert_cache_slots == 4


def test_sharded_checkpoint_and_missing_expert(tiny_moe_dir, moe_prompts, tmp_path) -> None:
    """The slow tier spans shards; a checkpoint lacking an expert is refused at load."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tiny_moe_dir("qwen3_moe")
    ref_tokens = runner_with_slots(folder).generate_greedy(moe_prompts, 6)
    state = load_file(f"{folder}/model.safetensors")
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner = runner_with_slots(str(sharded), slots=2, drop_page_cache=True)
    assert runner.generate_greedy(moe_prompts, 6) == ref_tokens
    runner.model.expert_store.close()

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    for slots in (None, 2):
        with pytest.raises(ValueError, match="layer 2 experts \\[5\\]"):
            load_model(str(broken), dtype="float32", moe_expert_cache_slots=slots)


def test_prefetch_never_evicts_protected_experts(tiny_moe_dir) -> None:
    """A prefetch takes a free slot or an unprotected one, else it is dropped."""
    runner = runner_with_slots(tiny_moe_dir("mixtral"), slots=2)
    store = runner.model.expert_store
    layer = store.layers()[0]
    assert store.prefetch_experts(layer, [0, 1]) == [0, 1]
    store.wait_loads()
    # both slots hold experts the caller still expects: nothing may be evicted for 2
    assert store.prefetch_experts(layer, [2], protect=[0, 1]) == []
    assert store.resident(layer) == [0, 1]
    # with 1 unprotected, expert 2 replaces it
    assert store.prefetch_experts(layer, [2], protect=[0]) == [2]
    store.wait_loads()
    assert store.resident(layer) == [0, 2]
    assert_baseline(store)
    store.close()


def test_reads_around_the_page_cache_place_each_expert_exactly(tiny_moe_dir) -> None:
    """With the page cache dropped, experts are read with O_DIRECT (an aligned span, then a
    memmove of the tensor's bytes) where the file system allows: every expert of every layer
    lands byte for byte as the checkpoint holds it, and the buffered path agrees."""
    from safetensors import safe_open

    from sglang.srt.expert_offload.sources import SafetensorsExpertSource

    folder = tiny_moe_dir("mixtral")
    runner = runner_with_slots(folder, slots=2, drop_page_cache=True)
    store = runner.model.expert_store
    source = store.source
    assert isinstance(source, SafetensorsExpertSource)
    buffered = SafetensorsExpertSource(folder, source.keys, drop_page_cache=False)
    layer = store.layers()[0]
    w13, w2 = (t[0].clone() for t in store.weights(layer))
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        for (lay, e), (gate, up, down) in sorted(source.keys.items()):
            for src in (source, buffered):
                w13.zero_(), w2.zero_()
                nbytes = src.read_into(lay, e, w13, w2)
                inter = w13.shape[0] // 2
                assert torch.equal(w13[:inter], f.get_tensor(gate))
                assert torch.equal(w13[inter:], f.get_tensor(up))
                assert torch.equal(w2, f.get_tensor(down))
                assert nbytes == (w13.numel() + w2.numel()) * w13.element_size()
    try:  # where this file system takes O_DIRECT, the source used it
        os.close(os.open(f"{folder}/model.safetensors", os.O_RDONLY | os.O_DIRECT))
        assert source._direct_fds is not None
    except OSError:
        pass
    buffered.close()
    store.close()


def test_a_page_aligned_checkpoint_loads_straight_into_the_slots(tiny_moe_dir, moe_prompts,
                                                                   tmp_path) -> None:
    """expert_layout.repack_folder puts every expert tensor on a page; with the page cache
    dropped each load is then one O_DIRECT read into its (page-aligned) slot, no bounce
    buffer; the tensors and the output are those of the original checkpoint, which still
    loads through the bounce buffer."""
    from safetensors import safe_open

    from sglang.srt.expert_offload.layout import ALIGN, expert_misalignment, repack_folder

    src = tiny_moe_dir("mixtral")
    dst = str(tmp_path / "aligned")
    assert expert_misalignment(f"{src}/model.safetensors")  # transformers' layout: off pages
    assert repack_folder(src, dst) == []
    assert sorted(os.listdir(dst)) == sorted(os.listdir(src))
    with safe_open(f"{src}/model.safetensors", "pt") as a, \
            safe_open(f"{dst}/model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    ref = runner_with_slots(src).generate_greedy(moe_prompts, 8)
    try:
        os.close(os.open(f"{dst}/model.safetensors", os.O_RDONLY | os.O_DIRECT))
        direct = True
    except OSError:
        direct = False
    for folder, how in ((dst, "direct"), (src, "bounced")):
        runner = runner_with_slots(folder, slots=2, drop_page_cache=True)
        store = runner.model.expert_store
        assert all(b.experts.w13.data_ptr() % ALIGN == 0 and b.experts.w2.data_ptr() % ALIGN == 0
                   for b in runner.model.moe_blocks().values())
        assert runner.generate_greedy(moe_prompts, 8) == ref
        assert_baseline(store)
        reads = store.source.reads
        if direct:
            assert reads[how] > 0 and sum(reads.values()) == reads[how], (folder, reads)
        store.close()


@pytest.mark.parametrize("needed,slots", [(1, 1), (5, 1), (3, 4), (4, 4), (5, 4), (10, 4),
                                          (7, 2), (9, 3), (0, 2)])
def test_waves_fit_the_slots_and_leave_room_to_load_the_next(needed, slots) -> None:
    """Every expert in exactly one wave, in order; no wave over the slots; when the experts
    do not all fit (and there are 2+ slots), each wave leaves the next one room to load."""
    from sglang.srt.layers.moe.experts import plan_waves

    experts = list(range(100, 100 + needed))
    waves = plan_waves(experts, slots)
    assert [e for w in waves for e in w] == experts
    assert all(0 < len(w) <= slots for w in waves)
    if needed <= slots:
        assert len(waves) <= 1
    elif slots >= 2:
        assert all(len(a) + len(b) <= slots for a, b in zip(waves, waves[1:]))


def test_a_layer_loads_its_next_wave_while_one_computes(tiny_moe_dir, moe_prompts) -> None:
    """Two slots, a prefill that routes to all 8 experts of every layer: the waves after
    the first arrive through the layer's own prefetch (loaded while the previous wave
    computed), not as misses found at acquire; the output is bit-identical to resident."""
    folder = tiny_moe_dir("mixtral")
    full = runner_with_slots(folder)
    ref_logits = full.prefill(moe_prompts, all_logits=True)
    runner = runner_with_slots(folder, slots=2)
    store = runner.model.expert_store
    assert torch.equal(runner.prefill(moe_prompts, all_logits=True), ref_logits)
    runner.release()
    total = store.stats().total()
    layers = len(store.layers())
    # per layer: at most the first wave's (and a wave whose prefetch lost a race) are misses
    assert total.prefetch_loads >= 4 * layers, total
    assert total.misses + total.prefetch_loads == total.loads
    assert_baseline(store)
    store.close()
