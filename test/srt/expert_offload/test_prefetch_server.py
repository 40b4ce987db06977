"""Draft-guided expert prefetch on a real server process: a tiny Mixtral with 2 of 8 experts
per layer resident, drafting for itself (STANDALONE, chain of 3), the `draft` predictor with
its default calibrated cut on every step. Native /generate returns exactly the tokens of the
in-process all-resident reference, the OpenAI client gets a completion, and /server_info and
/metrics show the prefetch's figures and the calibration it learned."""

from __future__ import annotations

import openai
import pytest
import requests
import torch

import sglang as sgl
from sglang.test.scheduler_driver import greedy, make_scheduler, run

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


@pytest.fixture(scope="module")
def server(tiny_moe_dir, tmp_path_factory):
    folder = tiny_moe_dir("mixtral")
    log = tmp_path_factory.mktemp("prefetch_server") / "server.log"
    runtime = sgl.Runtime(model_path=folder, dtype="float32", log_file=str(log),
                          enable_metrics=True, moe_expert_cache_slots=2,
                          moe_prefetch_predictor="draft", moe_prefetch_disable_gate=True,
                          speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=folder, speculative_num_steps=3,
                          speculative_disable_cost_model=True)
    yield runtime, folder
    runtime.shutdown()


def test_prefetching_server_returns_the_all_resident_tokens(server) -> None:
    runtime, folder = server
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() * 2 for n in (7, 12)]
    ref_sched = make_scheduler(folder)  # every expert resident, no speculation
    ref = run(ref_sched, prompts, [greedy(16)] * len(prompts))
    ref_sched.check_all_free()
    for i, ids in enumerate(prompts):
        out = requests.post(runtime.url + "/generate", json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
            timeout=300).json()
        assert out["output_ids"] == ref[str(i)][0], i
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="none")
    done = client.completions.create(model="default", prompt="The Licensee shall",
                                     max_tokens=8, temperature=0)
    assert done.usage.completion_tokens == 8

    info = requests.get(runtime.url + "/server_info", timeout=30).json()
    assert info["moe_prefetch_min_prob"] == pytest.approx(0.4)
    figs = info["internal_states"][0]["moe_prefetch"]
    assert figs["predictor"] == "draft" and figs["total"]["uses"] > 0
    assert 0.0 <= figs["total"]["recall"] <= 1.0
    # the draft reads its own residuals: their top ranks are learned as near-certain
    own = figs["calibration"]["own"]
    assert len(own) == 8 and own[0] > 0.9 and own[0] >= own[-1]
    metrics = requests.get(runtime.url + "/metrics", timeout=30).text
    assert 'sglang:moe_prefetch_recall{layer="all"' in metrics
