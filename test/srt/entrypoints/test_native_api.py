"""SGLang's native HTTP API against a real server: response shapes field by field, batch and
streaming, max_new_tokens 0, the input-logprob rules, concurrency, disconnects, bad input."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "reasoning_tokens", "weight_version", "total_retractions", "e2e_latency"}


def greedy(max_new: int = 8, **kw) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **kw}


def sse_events(resp: requests.Response):
    """The JSON chunks of an SSE stream; asserts it ends with [DONE]."""
    lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    assert all(ln.startswith(b"data: ") for ln in lines)
    return [json.loads(ln[len(b"data: "):]) for ln in lines[:-1]]


def test_single_response_shape(server):
    out = server.post("/generate", json={"text": "The contract shall", "sampling_params": greedy(5),
                                         "rid": "my-rid"}).json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert meta["prompt_tokens"] > 0 and meta["weight_version"] == "default"
    assert meta["reasoning_tokens"] == 0 and meta["total_retractions"] == 0
    assert isinstance(out["text"], str) and isinstance(meta["e2e_latency"], float)


def test_batch_is_a_list_in_input_order(server):
    prompts = ["Clause one", "Payment terms are due", "Either party"]
    batch = server.post("/generate", json={"text": prompts, "sampling_params": greedy(4)}).json()
    assert isinstance(batch, list) and len(batch) == 3
    for p, b in zip(prompts, batch):
        single = server.post("/generate", json={"text": p, "sampling_params": greedy(4)}).json()
        assert b["output_ids"] == single["output_ids"]
        assert b["meta_info"]["prompt_tokens"] == single["meta_info"]["prompt_tokens"]


def test_n_groups_samples_by_prompt(server):
    ids = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    out = server.post("/generate", json={"input_ids": ids,
                                         "sampling_params": greedy(3, n=2)}).json()
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [4, 4, 6, 6]
    assert out[0]["output_ids"] == out[1]["output_ids"]  # greedy samples agree
    single = server.post("/generate", json={"text": "Hello", "sampling_params": greedy(3, n=3)}).json()
    assert isinstance(single, list) and len(single) == 3


def test_max_new_tokens_zero(server):
    out = server.post("/generate", json={"text": "Warm me", "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stream_is_cumulative_and_ends_with_done(server):
    resp = server.post("/generate", json={"text": "Stream this", "sampling_params": greedy(6),
                                          "stream": True}, stream=True)
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(resp)
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert [len(c["output_ids"]) for c in chunks] == [c["meta_info"]["completion_tokens"] for c in chunks]
    whole = server.post("/generate", json={"text": "Stream this", "sampling_params": greedy(6)}).json()
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]


def test_batch_stream_chunks_carry_index(server):
    resp = server.post("/generate", json={"text": ["a b", "c d e"], "sampling_params": greedy(3),
                                          "stream": True}, stream=True)
    chunks = sse_events(resp)
    assert {c["index"] for c in chunks} == {0, 1}
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]


@pytest.mark.parametrize("start", [0, 3, 11])
def test_input_logprob_rules(server, start):
    ids = list(range(100, 112))  # 12 prompt tokens
    out = server.post("/generate", json={
        "input_ids": ids, "sampling_params": greedy(3), "return_logprob": True,
        "logprob_start_len": start, "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert meta["prompt_tokens"] == start + len(inp) == 12
    assert inp[0][0] is None  # no context before the first listed position
    assert all(isinstance(e[0], float) for e in inp[1:])
    assert [e[1] for e in inp] == ids[start:]
    assert all(isinstance(e[2], str) for e in inp)
    assert len(meta["input_top_logprobs"]) == len(inp) and meta["input_top_logprobs"][0] is None
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    assert meta["output_token_logprobs_length"] == 3
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_default_logprob_start_lists_last_prompt_token(server):
    ids = [300, 301, 302, 303]
    out = server.post("/generate", json={"input_ids": ids, "sampling_params": greedy(2),
                                         "return_logprob": True}).json()
    assert out["meta_info"]["input_token_logprobs"] == [[None, 303, None]]
    warm = server.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True}).json()
    assert warm["meta_info"]["input_token_logprobs"] == []
    assert warm["meta_info"]["output_token_logprobs"] == []


def test_concurrent_greedy_equals_one_at_a_time(server):
    prompts = [f"Request number {i} asks about clause {i * 7 % 13}" + " and more" * (i % 5)
               for i in range(32)]
    body = lambda p: {"text": p, "sampling_params": greedy(8)}  # noqa: E731
    alone = [server.post("/generate", json=body(p)).json()["output_ids"] for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: server.post("/generate", json=body(p)).json()["output_ids"],
                                 prompts))
    assert together == alone
    server.assert_all_slots_free()


def test_dropped_stream_frees_its_slots(server):
    resp = server.post("/generate", json={"text": "Keep going", "stream": True,
                                          "sampling_params": greedy(200)}, stream=True)
    lines = resp.iter_lines()
    got = [next(lines) for _ in range(6)]
    assert got[0].startswith(b"data: ")
    resp.close()  # the client goes away mid-stream
    server.assert_all_slots_free()
    # A non-streaming client that times out is aborted too (the timeout is well below the
    # time 240 tokens take, even on a fast machine: 200 tokens took < 0.5 s there).
    with pytest.raises(requests.exceptions.ReadTimeout):
        server.post("/generate", json={"text": "Long", "sampling_params": greedy(240)}, timeout=0.1)
    server.assert_all_slots_free()


def test_abort_request_by_rid(server):
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(server.post, "/generate",
                          json={"text": "Abort me", "rid": "to-abort", "sampling_params": greedy(220)})
        for _ in range(200):
            if server.internal_state()["num_running_reqs"]:
                break
            time.sleep(0.02)
        assert server.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        out = fut.result().json()
    assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length")
    server.assert_all_slots_free()


BAD_REQUESTS = [
    ('{"text": "x",', "not valid JSON"),
    ('{}', "Exactly one of text, input_ids"),
    ('{"text": 5}', "text must be"),
    ('{"text": "x", "sampling_params": "hot"}', "sampling_params must be"),
    ('{"text": "x", "stream": "yes"}', "stream must be"),
    ('{"text": "x", "sampling_params": {"temperature": -1}}', "temperature must be non-negative"),
    ('{"text": "x", "sampling_params": {"top_p": 5}}', "top_p must be in (0, 1]"),
    ('{"text": "x", "sampling_params": {"max_new_tokens": -3}}', "max_new_tokens"),
    ('{"text": "x", "sampling_params": {"max_new_tokens": "ten"}}', "max_new_tokens must be an integer"),
    ('{"text": "x", "sampling_params": {"max_new_tokens": 1000000000}}', "maximum context length of 256"),
    ('{"text": "x", "sampling_params": {"n": 0}}', "n must be"),
    ('{"text": "x", "sampling_params": {"temprature": 0.5}}', "Unknown sampling parameter"),
    ('{"input_ids": [1, 99999999]}', "not a token id"),
    ('{"input_ids": [1, 2, 3], "return_logprob": true, "logprob_start_len": 7}', "logprob_start_len"),
    ('{"input_ids": %s}' % list(range(300)), "The input (300 tokens) is longer than the model's "
                                             "context length (256 tokens)"),
]


@pytest.mark.parametrize("body,message", BAD_REQUESTS)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_400_and_server_survives(server, body, message, stream):
    if stream and body.startswith("{") and body.endswith("}") and '"stream"' not in body:
        body = body[:-1] + (', "stream": true}' if body != "{}" else '"stream": true}')
    resp = requests.post(server.base_url + "/generate", data=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]["message"]
    ok = server.post("/generate", json={"text": "still fine?", "sampling_params": greedy(2)})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_info_endpoints(server, tiny_llama_dir):
    info = server.get("/get_model_info").json()
    assert info["model_path"] == tiny_llama_dir and info["is_generation"] is True
    assert server.get("/model_info").json() == info
    si = server.get("/get_server_info").json()
    assert isinstance(si["max_total_num_tokens"], int) and isinstance(si["version"], str)
    assert "avg_spec_accept_length" in si["internal_states"][0]
    assert si["model_path"] == tiny_llama_dir and si["status"] == "ready"
    assert server.get("/health").status_code == 200
    assert server.get("/metrics").status_code == 404  # metrics are off by default
    assert si["dp_size"] == 1
    # upstream's /get_load (the sglang-router polls it): one entry per dp rank; idle here,
    # every request finished, its KV cached (evictable) or free
    assert server.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_a_body_nested_too_deeply_is_400(server):
    """100,000 nested arrays make the JSON parser recurse past its limit: a 400 that says so
    (it was a 500), and the server goes on serving."""
    body = '{"text": ' + "[" * 100000 + "]" * 100000 + "}"
    resp = requests.post(server.base_url + "/generate", data=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "nested too deeply" in resp.json()["error"]["message"]
    ok = server.post("/generate", json={"text": "still fine?", "sampling_params": greedy(2)})
    assert ok.status_code == 200


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """--max-request-body-bytes (1M on this server): a body declaring more gets a 413 naming
    the flag, on the native and the OpenAI routes (OpenAI's error shape there), whether its
    size is declared or it arrives chunked; the server goes on serving."""
    big = b'{"text": "' + b"a" * (1024 * 1024 + 10) + b'"}'
    resp = requests.post(server.base_url + "/generate", data=big, timeout=30)
    assert resp.status_code == 413, resp.text
    assert "--max-request-body-bytes" in resp.json()["error"]["message"]
    resp = requests.post(server.base_url + "/v1/completions", data=big, timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["code"] == 413, resp.text

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(20):
            yield b"a" * (64 * 1024)
        yield b'"}'

    resp = requests.post(server.base_url + "/generate", data=chunks(), timeout=30)
    assert resp.status_code == 413, resp.text
    ok = server.post("/generate", json={"text": "still fine?", "sampling_params": greedy(2)})
    assert ok.status_code == 200
