"""The OpenAI-compatible API through the real `openai` client (and raw HTTP for bytes the
client hides): completions, chat, streaming, n, stop, logprobs, models, errors."""

from __future__ import annotations

import json

import openai
import pytest
import requests

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "system", "content": "You review contracts."},
            {"role": "user", "content": "Is clause 4 enforceable?"}]


def test_models(client, server, tiny_llama_dir):
    models = client.models.list()
    assert len(models.data) == 1
    card = models.data[0]
    assert card.id == tiny_llama_dir and card.owned_by == "sglang" and card.object == "model"
    assert card.max_model_len == 256  # the server's --context-length
    raw = server.get("/v1/models").json()
    assert raw["object"] == "list" and set(raw["data"][0]) == {
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_basic_and_usage(client, server):
    r = client.completions.create(model="anything", prompt="The supplier shall", max_tokens=6,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "anything" and r.id.startswith("cmpl-")
    ch = r.choices[0]
    assert ch.index == 0 and ch.finish_reason == "length" and ch.logprobs is None
    native = server.post("/generate", json={"text": "The supplier shall", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert ch.text == native["text"]
    assert r.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_n_list_and_token_prompts(client):
    r = client.completions.create(model="m", prompt=["Alpha beta", "Gamma"], max_tokens=3, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy samples of one prompt agree
    assert r.usage.completion_tokens == 12
    ids = client.completions.create(model="m", prompt=[[10, 20, 30], [40, 50]], max_tokens=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_completion_echo_and_logprobs(client):
    r = client.completions.create(model="m", prompt="Payment is due", max_tokens=3, temperature=0,
                                  echo=True, logprobs=2, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith("Payment is due")
    lp = ch.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    plain = client.completions.create(model="m", prompt="Payment is due", max_tokens=3,
                                      temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    assert len(plain.choices[0].logprobs.token_logprobs) == 3


def test_completion_stop_and_matched_stop(client):
    free = client.completions.create(model="m", prompt="Terms:", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[3:6]
    assert stop.strip(), free
    r = client.completions.create(model="m", prompt="Terms:", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.model_extra["matched_stop"] == stop
    assert ch.text == free[: free.index(stop)]
    length = client.completions.create(model="m", prompt="Terms:", max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert length.finish_reason == "length" and length.model_extra["matched_stop"] is None


def test_completion_stream_with_usage(client):
    chunks = list(client.completions.create(
        model="m", prompt="Stream me", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    whole = client.completions.create(model="m", prompt="Stream me", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert len({c.id for c in chunks}) == 1


def test_chat_basic_logprobs_and_n(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3, n=2,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert [c.index for c in r.choices] == [0, 1]
    for ch in r.choices:
        assert ch.message.role == "assistant" and ch.finish_reason == "length"
        assert len(ch.logprobs.content) == 4
        for tok in ch.logprobs.content:
            assert len(tok.top_logprobs) == 3
            assert tok.bytes == list(tok.token.encode())
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 8
    meta = r.model_extra.get("metadata") or getattr(r, "metadata", None)
    assert meta == {"weight_version": "default"}


def test_chat_uses_the_chat_template(client, server, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    native = server.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert r.choices[0].message.content == native["text"]


def test_chat_stream_role_deltas_one_finish_per_choice_usage(client):
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    for index in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert sum(c.finish_reason is not None for c in mine) == 1
        assert mine[-1].finish_reason == "length"
        assert all(c.delta.role is None for c in mine[1:])
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
    text0 = "".join(c.choices[0].delta.content or "" for c in body if c.choices[0].index == 0)
    assert text0 == whole.choices[0].message.content


def test_chat_stop_string(client):
    free = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    content = free.choices[0].message.content
    stop = content[4:7]
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0,
                                       stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop
    assert (r.choices[0].message.content or "") == content[: content.index(stop)]


def _post(server, path, body, content_type="application/json"):
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(server.base_url + path, data=data, timeout=30,
                         headers={"Content-Type": content_type})


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", '{"prompt": "x",', "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature must be non-negative"),
    ("/v1/completions", {"prompt": "   "}, "Prompt cannot be empty"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 100000}, "maximum context length"),
    ("/v1/chat/completions", {"messages": []}, "messages must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p"),
])
def test_openai_errors_are_flat_400(server, path, body, message):
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert set(err) == {"object", "message", "type", "param", "code"}
    assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError"
    assert message in err["message"]
    ok = _post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_needs_json_content_type(server):
    resp = _post(server, "/v1/completions", '{"prompt": "x"}', content_type="text/plain")
    assert resp.status_code == 400 and "application/json" in resp.json()["message"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=2, temperature=-3)
    assert "temperature" in str(e.value)


def test_openai_body_nested_too_deeply_is_400(server):
    resp = _post(server, "/v1/chat/completions",
                 '{"messages": ' + "[" * 100000 + "]" * 100000 + "}")
    assert resp.status_code == 400, resp.text
    assert "nested too deeply" in resp.json()["message"]
    assert _post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2}).status_code == 200
