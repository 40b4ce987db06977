"""The step's device-to-host reads are few, named and counted (issue 29, utils/host_sync.py).

On CPU a read costs nothing, but every one a GPU step would make runs here too: a torch
function mode sees each raw read (tolist, item, bool/int/float of a tensor, cpu()), and the
scheduler's count names them by call site.
"""

from __future__ import annotations

import collections
import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler_process import scheduler_info
from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils import host_sync
from sglang.test.scheduler_driver import greedy, make_scheduler

# Reads of host tensors by design: the CPU attention backend's slot runs (CUDA's default is
# triton) and the uniform a sampled row draws on its CPU generator
HOST_SIDE = {("torch_native_backend.py", "_as_slice"), ("sampler.py", "draw_from_probs"),
             # a sampled verify walks the host copy of its probabilities (`verify_probs`)
             ("verify.py", "verify_sampling"), ("verify.py", "_uniform"), ("verify.py", "_draw")}


class RawReads(TorchFunctionMode):
    """Counts every read of a tensor's values by the host during the block, by the file and
    function that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: "collections.Counter[tuple]" = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if host_sync.is_read(func, args):
            caller = traceback.extract_stack(limit=2)[0]
            self.counts[(os.path.basename(caller.filename), caller.name)] += 1
        return func(*args, **(kwargs or {}))

    def unnamed(self) -> dict:
        """Reads neither through host_sync nor host-side by design."""
        return {k: n for k, n in self.counts.items()
                if k[0] != "host_sync.py" and k not in HOST_SIDE}


def _add(sched, rid: str, prompt, params) -> None:
    assert sched.add_request(TokenizedGenerateReqInput(
        rid=rid, input_ids=prompt, sampling_params=SamplingParams.from_dict(params))) is None


def _as_on_a_gpu(sched) -> None:
    """KV frees check their slots on the device, as a GPU pool does (on the host they read
    the slots at once: free there)."""
    sched.allocator.defer_checks = True
    if sched.spec is not None and sched.spec.draft_allocator is not None:
        sched.spec.draft_allocator.defer_checks = True


def _to_decode(sched) -> None:
    """Step until every running request decodes (its prompt is computed)."""
    _as_on_a_gpu(sched)
    for _ in range(50):
        sched.step()
        if sched.running and all(r.fill_len - r.kv_len == 1 for r in sched.running):
            return
    raise AssertionError("prompts never finished")


def _finish(sched) -> None:
    while not sched.is_idle():
        sched.step()
    sched.check_all_free()


PROMPTS = [[1, 15, 27, 99, 4, 8, 16, 23, 42], [1, 7, 7, 300, 12, 5]]


def test_a_plain_greedy_decode_step_reads_the_device_once(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        _add(sched, str(i), p, greedy(8))
    _to_decode(sched)
    with RawReads() as raw:
        sched.step()
    # the batch's next tokens, one copy for both requests; nothing else reads a tensor
    assert sched.sync_stats.last_step == {"next_token_ids": 1}
    assert raw.counts[("host_sync.py", "to_list")] == 1 and not raw.unnamed(), raw.counts
    _finish(sched)
    info = scheduler_info(sched)["host_syncs"]
    assert info["per_decode_step"] == {"next_token_ids": 1.0}
    assert info["decode_steps"] >= 7


def test_sampling_reads_only_its_named_sites(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir)
    params = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "min_p": 0.05,
              "ignore_eos": True, "sampling_seed": 7}
    _add(sched, "s", PROMPTS[0], params)
    _add(sched, "g", PROMPTS[1], greedy(6))  # a greedy row beside it
    _to_decode(sched)
    with RawReads() as raw:
        sched.step()
    last = sched.sync_stats.last_step
    # top-p grows its sorted head until it holds the mass, a read each time (a random
    # model's flat distribution needs several: 256, 2048, ... tokens)
    assert set(last) == {"next_token_ids", "top_p_head"} and last["next_token_ids"] == 1, last
    assert not raw.unnamed(), raw.counts
    _finish(sched)


def test_draft_model_tree_reads_once_per_level(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_dir,
                           speculative_num_steps=3, speculative_eagle_topk=2,
                           speculative_num_draft_tokens=6)
    for i, p in enumerate(PROMPTS):
        _add(sched, str(i), p, greedy(10))
    _to_decode(sched)
    with RawReads() as raw:
        sched.step()
    last = sched.sync_stats.last_step
    # both requests' top-k of a level in one copy of values and one of ids, 3 levels; the
    # slots of the 2 levels forwarded after the first in one read each; both trees' argmax
    # in one read (greedy verifies of a step together)
    assert last == {"draft_topk": 6, "draft_slots": 2, "verify_ids": 1}, last
    assert not raw.unnamed(), raw.counts
    _finish(sched)


def test_a_sampled_verify_copies_its_probabilities_once(tiny_llama_dir):
    sched = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_dir,
                           speculative_num_steps=3)
    params = {"max_new_tokens": 10, "temperature": 0.7, "ignore_eos": True,
              "sampling_seed": 3}
    for i, p in enumerate(PROMPTS):
        _add(sched, str(i), p, params)
    _to_decode(sched)
    with RawReads() as raw:
        sched.step()
    last = sched.sync_stats.last_step
    # the acceptance walk reads a tree's probabilities many times: one copy per request
    assert last.get("verify_probs") == 2 and "verify_ids" not in last, last
    assert not raw.unnamed(), raw.counts
    _finish(sched)


def test_deferred_free_checks_catch_a_double_free_without_reading_per_free():
    alloc = TokenSlotAllocator(16)
    alloc.defer_checks = True  # what a GPU pool does
    slots = alloc.alloc(4)
    with RawReads() as raw:
        alloc.free(slots[:2])
    assert not raw.counts, raw.counts
    alloc.check()  # nothing wrong yet
    alloc.free(torch.tensor([slots[0].item()]))  # freed twice
    with pytest.raises(AssertionError, match="already free"):
        alloc.check()


def test_deferred_free_checks_catch_a_slot_out_of_range():
    alloc = TokenSlotAllocator(16)
    alloc.defer_checks = True
    alloc.alloc(2)
    alloc.free(torch.tensor([17]))  # past the pool: no fault, reported by check()
    with pytest.raises(AssertionError, match="out of range"):
        alloc.check()


def test_moe_torch_runner_reads_its_expert_groups_once_per_layer(tiny_moe_dir):
    sched = make_scheduler(tiny_moe_dir("mixtral"))
    for i, p in enumerate(PROMPTS):
        _add(sched, str(i), p, greedy(6))
    _to_decode(sched)
    sched.step()
    layers = sched.runner.config.num_hidden_layers
    # the CPU runner loops over the experts a step routed to; the Triton runner (CUDA's
    # default) reads nothing
    assert sched.sync_stats.last_step == {"next_token_ids": 1, "moe_expert_groups": layers}
    _finish(sched)


def test_id_counts_match_unique_and_read_once():
    """The MoE's expert groups and needed experts come from one fixed-size read (no
    data-dependent `unique` on the device): the same groups and ids as torch.unique, -1
    (pairs outside this rank or wave) counted first."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        ids = torch.randint(-1, n, (int(torch.randint(1, 40, (1,), generator=gen)), 2),
                            generator=gen)
        host_sync.take()
        with RawReads() as raw:
            counts = host_sync.id_counts(ids, n, "t")
            present = host_sync.present_ids(ids, n, "t")
        assert not raw.unnamed(), raw.counts
        assert host_sync.take() == {"t": 2}
        values, got = torch.unique(ids, return_counts=True)
        want = dict(zip(values.tolist(), got.tolist()))
        assert counts == [want.get(v, 0) for v in range(-1, n)]
        assert present == [v for v in values.tolist() if v >= 0]


def test_named_reads_of_meta_tensors_give_ones_and_unnamed_ones_raise():
    """A meta tensor (the device tests' GPU) has no values: the named reads return ones of
    its shape, so a meta forward walks its data-dependent paths; a raw read still fails."""
    t = torch.empty((2, 3), dtype=torch.int64, device="meta")
    assert host_sync.to_list(t, "t") == [[1, 1, 1], [1, 1, 1]]
    assert host_sync.to_int(t[0, 0], "t") == 1 and host_sync.to_bool(t[0, 0], "t") is True
    assert host_sync.to_cpu(t, "t").device.type == "cpu"
    assert host_sync.present_ids(t, 4, "t") == [0, 1, 2, 3]
    with pytest.raises(Exception):
        t.tolist()
