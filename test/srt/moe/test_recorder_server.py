"""The expert distribution endpoints on a real server process with a tiny Mixtral: start,
generate, stop, dump; the dump file holds one record per forward with top-k experts per
token and layer, and its counts add up to what was recorded."""

from __future__ import annotations

import os

import pytest
import requests
import torch

import sglang as sgl

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


@pytest.fixture(scope="module")
def server(tiny_moe_dir, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("expert_dumps")
    os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = str(dump_dir)
    try:
        runtime = sgl.Runtime(model_path=tiny_moe_dir("mixtral"), dtype="float32",
                              log_file=str(dump_dir / "server.log"))
    finally:
        del os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"]
    yield runtime, str(dump_dir)
    runtime.shutdown()


def test_start_generate_stop_dump(server) -> None:
    runtime, dump_dir = server
    assert requests.post(runtime.url + "/start_expert_distribution_record").json()["success"]
    out = requests.post(runtime.url + "/generate", json={
        "text": "The Licensee shall not sublicense",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
    assert out["meta_info"]["completion_tokens"] == 5
    assert requests.post(runtime.url + "/stop_expert_distribution_record").json()["success"]
    # Recording is stopped: this request must not show up in the dump.
    requests.post(runtime.url + "/generate", json={
        "text": "unrecorded", "sampling_params": {"max_new_tokens": 3}})
    body = requests.post(runtime.url + "/dump_expert_distribution_record").json()
    assert body["success"], body
    assert os.path.dirname(body["path"]) == dump_dir
    dump = torch.load(body["path"], weights_only=False)
    meta = out["meta_info"]
    computed = meta["prompt_tokens"] - meta["cached_tokens"]  # a warm-up may have cached BOS
    # the prompt's uncached tokens, then 4 decode forwards (the 5th token needs no forward)
    tokens = sum(step["topk_ids"][0].shape[0] for step in dump["steps"])
    assert tokens == computed + 4, (tokens, meta)
    assert dump["counts"].shape == (dump["num_layers"], dump["num_experts"])
    assert (dump["counts"].sum(dim=1) == tokens * dump["top_k"]).all()
    assert body["counts"] == dump["counts"].tolist()


def test_unknown_and_admin(server) -> None:
    runtime, _ = server
    # GET is accepted as upstream does; the server keeps serving afterwards.
    assert requests.get(runtime.url + "/stop_expert_distribution_record").status_code == 200
    assert requests.get(runtime.url + "/health").status_code == 200
