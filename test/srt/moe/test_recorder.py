"""The expert distribution recorder records exactly the routers' choices; the scheduler-side
handler and the HTTP routes drive it."""

from __future__ import annotations

import torch

from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.managers.expert_record_handler import (ExpertDistributionReq,
                                                       handle_expert_distribution_req,
                                                       register_expert_record_routes)
from sglang.srt.mem_cache.mla_pool import create_kv_pool
from sglang.test.harness import TinyRunner


def _capture_router_choices(model):
    """layer -> list of the topk_ids each forward's router produced (forward hooks)."""
    seen = {}
    for layer, block in model.moe_blocks().items():
        def hook(_mod, _inp, out, layer=layer):
            seen.setdefault(layer, []).append(out.topk_ids.clone())
        block.gate.register_forward_hook(hook)
    return seen


def test_recorder_matches_router_choices(tiny_moe_dir, moe_prompts, tmp_path) -> None:
    folder = tiny_moe_dir("deepseek_v3")
    runner = TinyRunner(folder, dtype="float32", kv_slots=1024)
    runner.kv_pool = create_kv_pool(runner.config, 1024, runner.dtype)
    seen = _capture_router_choices(runner.model)
    recorder = get_expert_recorder()
    runner.prefill(moe_prompts[:1])  # not recorded: recording is off
    runner.release()
    seen.clear()
    assert handle_expert_distribution_req(ExpertDistributionReq("start")).success
    runner.generate_greedy(moe_prompts, 3)  # one EXTEND + two DECODE steps
    assert handle_expert_distribution_req(ExpertDistributionReq("stop")).success
    runner.generate_greedy(moe_prompts, 2)  # not recorded either
    out = handle_expert_distribution_req(ExpertDistributionReq("dump", str(tmp_path)))
    assert out.success and out.path.startswith(str(tmp_path))
    dump = torch.load(out.path)
    moe_layers = sorted(runner.model.moe_blocks())  # layer 0 is dense (first_k_dense_replace)
    assert dump["num_experts"] == 8 and dump["top_k"] == 2 and len(dump["steps"]) == 3
    assert out.summary["num_steps"] == 3
    counts = torch.zeros(dump["counts"].shape, dtype=torch.int64)
    for i, step in enumerate(dump["steps"]):
        assert sorted(step["topk_ids"]) == moe_layers
        n_tokens = sum(len(p) for p in moe_prompts) if i == 0 else len(moe_prompts)
        assert step["input_ids"].shape == (n_tokens,)
        for layer, ids in step["topk_ids"].items():
            assert torch.equal(ids.long(), seen[layer][i])
            counts[layer] += torch.bincount(ids.reshape(-1).long(), minlength=8)
    assert torch.equal(counts, dump["counts"])
    assert dump["counts"][0].sum() == 0  # the dense layer routes nothing
    recorder.reset()


def test_recorder_agrees_with_transformers_router(tiny_moe_dir, moe_prompts) -> None:
    """Same expert sets per token as transformers' Mixtral router on the same prompt."""
    from transformers import AutoModelForCausalLM

    folder = tiny_moe_dir("mixtral")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf(torch.tensor([moe_prompts[1]]), output_router_logits=True)
    runner = TinyRunner(folder, dtype="float32", kv_slots=1024)
    recorder = get_expert_recorder()
    recorder.start()
    runner.prefill([moe_prompts[1]])
    recorder.stop()
    snap = recorder.snapshot()
    recorder.reset()
    (step,) = snap["steps"]
    for layer, logits in enumerate(hf_out.router_logits):
        hf_sets = logits.topk(2, dim=-1).indices.sort(-1).values
        assert torch.equal(step["topk_ids"][layer].long().sort(-1).values, hf_sets)


def test_http_routes(tiny_moe_dir, tmp_path) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    sent = []

    async def send(action):
        sent.append(action)
        return handle_expert_distribution_req(ExpertDistributionReq(action, str(tmp_path)))

    register_expert_record_routes(app, send)
    client = TestClient(app)
    assert client.post("/start_expert_distribution_record").json()["success"]
    assert client.post("/stop_expert_distribution_record").json()["success"]
    body = client.post("/dump_expert_distribution_record").json()
    assert body["success"] and body["path"].startswith(str(tmp_path)) and "counts" in body
    assert sent == ["start", "stop", "dump"]
