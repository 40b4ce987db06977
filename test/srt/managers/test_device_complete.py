"""A step is device-complete: every tensor of a built batch lives on the runner's device, and a
whole model forward runs there with nothing made on the host.

The `meta` device stands in for a GPU: mixing a CPU tensor into a meta computation raises, and
so does any `.item()` / `.tolist()` of a meta tensor that does not go through `host_sync`'s
named reads (which give ones on meta), so these tests catch on a CPU-only machine what would
break or stall on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang.srt.managers.batch_builder import build_forward_batch
from sglang.srt.managers.output_processor import OutputProcessor
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.step_plan import ScheduledReq, StepPlan
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.tree import DraftTree


def _runner(model_dir: str, device: str, **kw) -> ModelRunner:
    args = ServerArgs(model_path=model_dir, device=device, dtype="float32",
                      attention_backend="torch_native", max_total_tokens=256, **kw)
    return ModelRunner(args, max_running_requests=2)


def _req(rid: str, prompt) -> Req:
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    params.normalize()
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=params)


def _tensor_fields(fb):
    out = {}
    for f in dataclasses.fields(fb):
        v = getattr(fb, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v
        elif isinstance(v, list):
            out.update({f"{f.name}[{i}]": t for i, t in enumerate(v) if isinstance(t, torch.Tensor)})
    return out


def _steps(runner: ModelRunner, pool: ReqToTokenPool, outputs: OutputProcessor):
    """Yield (plan, batch) for a prefill of two requests (one with a prefix already in KV),
    a decode step of both, and a verify of a 3-node tree beside a decode."""
    a, b = _req("a", [5, 17, 9, 33, 2, 41]), _req("b", [7, 8, 99, 100])
    for r in (a, b):
        r.req_pool_idx = pool.alloc()

    def plan_of(items):
        for it in items:  # what Scheduler._allocate does
            slots = runner.allocator.alloc(it.num_tokens)
            pool.write(it.req.req_pool_idx, it.req.kv_len, slots)
        return StepPlan(items, decode_only=all(it.count == 1 for it in items))

    b.kv_len = 2  # b's first two tokens came from the prefix cache
    pool.write(b.req_pool_idx, 0, runner.allocator.alloc(2))
    plan = plan_of([ScheduledReq(a, 6), ScheduledReq(b, 2)])
    yield plan, build_forward_batch(plan, pool, runner, outputs)
    a.kv_len, b.kv_len = 6, 4
    a.output_ids.append(11)
    b.output_ids.append(12)
    plan = plan_of([ScheduledReq(a, 1), ScheduledReq(b, 1)])
    yield plan, build_forward_batch(plan, pool, runner, outputs)
    a.kv_len, b.kv_len = 7, 5
    a.output_ids.append(13)
    b.output_ids.append(14)
    tree = DraftTree.root_only(13)
    tree.add(20, 0, -0.1)
    tree.add(21, 0, -0.5)
    plan = plan_of([ScheduledReq(a, 1, tree=tree), ScheduledReq(b, 1)])
    yield plan, build_forward_batch(plan, pool, runner, outputs)


def test_built_batch_lives_on_the_runner_device(tiny_llama_dir) -> None:
    """Every tensor a ForwardBatch carries (ids, positions, slots, lengths, logit rows, tree
    masks) is made on the runner's device, and the host mirrors match them."""
    runner = _runner(tiny_llama_dir, "meta")
    pool = ReqToTokenPool(2, 64, device="meta")
    outputs = OutputProcessor(runner.vocab_size, None, eos_token_ids={2})
    modes = []
    for plan, (fb, _rows) in _steps(runner, pool, outputs):
        fields = _tensor_fields(fb)
        assert {"input_ids", "positions", "out_cache_loc", "seq_lens", "logits_indices"} <= set(fields)
        off = {name: t.device for name, t in fields.items() if t.device.type != "meta"}
        assert not off, f"batch tensors left off the device: {off}"
        assert fb.req_pool_indices_cpu == [r.req_pool_idx for r in plan.reqs]
        assert fb.pool_rows() == fb.req_pool_indices_cpu  # no device read for the rows
        modes.append(fb.forward_mode.name)
    assert modes == ["EXTEND", "DECODE", "TARGET_VERIFY"]
    assert pool.req_to_token.device.type == "meta"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral_store", "deepseek_v2"])
def test_model_forward_on_meta_makes_nothing_on_the_host(arch, tiny_llama_dir, tiny_qwen2_dir,
                                                         tiny_moe_dir) -> None:
    """Weights, KV pool, req_to_token table and batch on `meta`: prefill, decode and a tree
    verify run through the real runner and attention backend; a CPU tensor mixed in, or an
    unnamed host read of a device tensor, would raise. Mixtral keeps 2 of its 8 experts per
    layer in an expert store (loads through the staging set into meta slots); DeepSeek-V2
    runs MLA and its routed and shared experts."""
    kw = {"moe_expert_cache_slots": 2} if arch == "mixtral_store" else {}
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}.get(arch) or \
        tiny_moe_dir(arch.split("_store")[0])
    runner = _runner(model_dir, "meta", **kw)
    assert next(runner.model.parameters()).device.type == "meta"
    store = getattr(runner.model, "expert_store", None)
    assert (store is not None) == (arch == "mixtral_store")
    pool = ReqToTokenPool(2, 64, device="meta")
    outputs = OutputProcessor(runner.vocab_size, None, eos_token_ids={2})
    for plan, (fb, rows) in _steps(runner, pool, outputs):
        logits = runner.forward(fb)
        wanted = sum(len(r.all_rows()) if hasattr(r, "all_rows") else len(r) for r in rows)
        assert logits.device.type == "meta"
        assert tuple(logits.shape) == (wanted, runner.vocab_size)
    if store is not None:
        # a named read of meta ids says every expert is needed: each one went through a slot
        layer = store.layers()[0]
        assert store.stats().layers[layer].loads >= 8
        assert {str(t.device) for t in store.weights(layer)} == {"meta"}
        store.check_idle()
        store.close()


def test_sampling_follows_the_logits_device() -> None:
    """The sampler's per-row tensors (temperatures, filters, penalties) are made on the logits'
    device: on CPU a run of sampled and greedy rows works as before; on meta the tensors it
    builds before drawing are meta tensors."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    reqs = [_req("g", [1, 2, 3]), _req("s", [4, 5, 6])]
    reqs[1].sampling_params = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9,
                                             top_k=20, repetition_penalty=1.2)
    reqs[1].sampling_params.normalize()
    info = SamplingBatchInfo.from_reqs(reqs, 64, device="meta")
    made = [info.temperatures, info.top_ps, info.top_ks, info.min_ps, info.is_greedy]
    rep = info.penalties.repetition  # the sampled row's prompt tokens, penalised
    made += [rep.rows, rep.tokens, rep.values]
    assert {t.device.type for t in made} == {"meta"}
    # the same rows on CPU sample as before: the greedy row takes the argmax
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    for r in reqs:
        r.generator = torch.Generator().manual_seed(1)
    OutputProcessor(64, None, eos_token_ids={2}).sample_and_append(reqs, logits)
    assert reqs[0].output_ids == [int(logits[0].argmax())]
    assert 0 <= reqs[1].output_ids[0] < 64


def test_draft_batch_lives_on_the_draft_device(tiny_llama_dir) -> None:
    """The draft model's batch (a catch-up or a tree level: ids, positions, slots, lengths,
    KV views, tree masks, built from host lists) is moved to the draft's device where it is
    made, and names its pool rows on the host (no device read)."""
    from sglang.srt.speculative.config import SpecConfig
    from sglang.srt.speculative.drafters import build_drafter

    args = ServerArgs(model_path=tiny_llama_dir, device="meta", dtype="float32",
                      attention_backend="torch_native", max_total_tokens=256,
                      speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=tiny_llama_dir)
    drafter = build_drafter(SpecConfig.from_server_args(args), args, 2, 128, 256, 64)
    assert torch.device(drafter.runner.device).type == "meta"
    req = _req("a", [5, 17, 9, 33])
    req.req_pool_idx = 0
    fb = drafter._batch([req], [5, 17], torch.arange(2), [4], [2], torch.tensor([3, 4]), [1],
                        kv_indices=[torch.tensor([1, 2, 3, 4])],
                        custom_mask=[torch.ones((2, 4), dtype=torch.bool)])
    fields = _tensor_fields(fb)
    assert {"input_ids", "positions", "out_cache_loc", "seq_lens", "logits_indices",
            "kv_indices[0]", "custom_mask[0]"} <= set(fields)
    off = {name: t.device for name, t in fields.items() if t.device.type != "meta"}
    assert not off, f"draft batch tensors left off the device: {off}"
    assert fb.pool_rows() == [0]
