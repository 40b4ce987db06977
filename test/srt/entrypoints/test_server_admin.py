"""A second server, configured through `--config file.yaml`: API key, metrics, served model
name, queue limit (503), auto-truncation, stream interval, and SIGTERM draining (last)."""

from __future__ import annotations

import json
import signal
import threading
import time

import openai
import pytest
import requests

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

KEY = "sk-test-123"
NAME = "tiny-served"


def greedy(max_new: int = 8, **kw) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def srv(start_server, tiny_llama_dir, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "server.yaml"
    cfg.write_text("\n".join([
        f"api-key: {KEY}", "enable-metrics: true", f"served-model-name: {NAME}",
        "max-running-requests: 1", "max-queued-requests: 1", "allow-auto-truncate: true",
        "context-length: 512", "stream-interval: 3", "max-total-tokens: 8192"]) + "\n")
    # argv wins over the file: context-length comes from the command line.
    return start_server(tiny_llama_dir, ["--config", str(cfg), "--context-length", "384"],
                        api_key=KEY)


def test_config_file_and_argv_merge(srv):
    info = srv.get("/server_info").json()
    assert info["api_key"] == KEY and info["enable_metrics"] is True
    assert info["served_model_name"] == NAME and info["max_queued_requests"] == 1
    assert info["context_length"] == 384 and info["stream_interval"] == 3


@pytest.mark.parametrize("method,path", [("post", "/generate"), ("get", "/v1/models"),
                                         ("get", "/server_info"), ("post", "/flush_cache"),
                                         ("post", "/v1/completions")])
def test_api_key_required(srv, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = getattr(requests, method)(srv.base_url + path, headers=headers, timeout=30,
                                         json={"text": "x"})
        assert resp.status_code == 401, (path, headers)
        assert resp.json() == {"error": "Unauthorized"}


def test_health_and_metrics_need_no_key(srv):
    assert requests.get(srv.base_url + "/health", timeout=30).status_code == 200
    assert requests.get(srv.base_url + "/metrics", timeout=30).status_code == 200


def test_openai_client_with_key_and_served_name(srv):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=2)
    assert r.model == NAME and r.usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_stream_interval(srv):
    resp = srv.post("/generate", json={"text": "Count", "sampling_params": greedy(9),
                                       "stream": True}, stream=True)
    chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln and ln != b"data: [DONE]"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 4, 7, 9]


def test_auto_truncate(srv):
    out = srv.post("/generate", json={"input_ids": list(range(10, 410)),
                                      "sampling_params": greedy(4)})
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["prompt_tokens"] < 384 and meta["prompt_tokens"] + meta["completion_tokens"] <= 384


def test_queue_limit_gives_503_at_once(srv):
    results = {}

    def run(name):
        results[name] = srv.post("/generate", json={"text": f"long {name}",
                                                    "sampling_params": greedy(300)}, timeout=120)

    first = threading.Thread(target=run, args=("running",))
    first.start()
    _wait_for(srv, lambda st: st["num_running_reqs"] == 1)
    second = threading.Thread(target=run, args=("queued",))
    second.start()
    _wait_for(srv, lambda st: st["num_waiting_reqs"] == 1)
    t0 = time.time()
    refused = srv.post("/generate", json={"text": "one too many", "sampling_params": greedy(2)})
    assert time.time() - t0 < 5
    assert refused.status_code == 503, refused.text
    assert "queue is full" in refused.json()["error"]["message"]
    oa = srv.post("/v1/completions", json={"prompt": "too many", "max_tokens": 2})
    assert oa.status_code == 503 and oa.json()["code"] == 503
    # The admitted requests are unaffected: they run on until aborted.
    assert srv.post("/abort_request", json={"abort_all": True}).status_code == 200
    first.join(60)
    second.join(60)
    for name in ("running", "queued"):
        assert results[name].status_code == 200
        assert results[name].json()["meta_info"]["finish_reason"]["type"] == "abort"
    srv.assert_all_slots_free()


def test_metrics_content(srv):
    resp = srv.post("/generate", json={"text": "Metrics please", "stream": True,
                                       "sampling_params": greedy(4)}, stream=True)
    assert resp.status_code == 200 and [ln for ln in resp.iter_lines() if ln][-1] == b"data: [DONE]"
    text = requests.get(srv.base_url + "/metrics", timeout=30).text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:num_requests_total",
                 "sglang:cached_tokens_total", "sglang:max_total_num_tokens",
                 "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:time_per_output_token_seconds", "sglang:e2e_request_latency_seconds",
                 "sglang:func_latency_seconds", "_sum{", "_count{", "_bucket{",
                 f'model_name="{NAME}"'):
        assert name in text, name
    values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith("sglang:") and "{" in ln and "_bucket" not in ln}
    assert values["sglang:generation_tokens_total"] >= 4
    assert values["sglang:max_total_num_tokens"] == 8192
    assert values["sglang:time_to_first_token_seconds_count"] >= 1


def test_sigterm_drains_then_exits_zero(srv):
    """Last test of the module: it stops the server."""
    resp = srv.post("/generate", json={"text": "Drain me", "stream": True,
                                       "sampling_params": greedy(60)}, stream=True)
    lines = resp.iter_lines()
    assert next(lines).startswith(b"data: ")
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        late = srv.post("/generate", json={"text": "late", "sampling_params": greedy(2)}, timeout=10)
        assert late.status_code == 503
    except requests.ConnectionError:
        pass  # already closed: also a refusal
    rest = [ln for ln in lines if ln]
    assert rest[-1] == b"data: [DONE]"
    final = json.loads(rest[-2][6:])
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert srv.proc.wait(30) == 0
    assert "SIGTERM received" in srv.log()


def _wait_for(srv, pred, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred(srv.internal_state()):
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached: {srv.internal_state()}")
