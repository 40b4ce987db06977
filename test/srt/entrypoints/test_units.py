"""Server helpers without a server: chat templates, OpenAI conversions, metrics."""

from __future__ import annotations

import json
import math
import types

import pytest

from sglang.srt.entrypoints.openai.chat_template import ChatRenderer, resolve_chat_template
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_base import json_bytes, openai_logprobs, usage


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _messages(*pairs):
    return ChatCompletionRequest(messages=[{"role": r, "content": c} for r, c in pairs]).messages


def test_chat_template_sources(tmp_path):
    assert resolve_chat_template(None) is None
    assert "<|im_start|>" in resolve_chat_template("chatml")
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert resolve_chat_template(str(jinja)).startswith("{% for")
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"chat_template": "X{{ messages[0]['content'] }}"}))
    assert resolve_chat_template(str(js)) == "X{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a file nor a known template"):
        resolve_chat_template("no-such-template")


def test_renderer_uses_tokenizer_template_or_override(tokenizer, tmp_path):
    msgs = _messages(("user", "hi"))
    own = ChatRenderer(tokenizer, None).render(msgs)
    assert own == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=False, add_generation_prompt=True)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}")
    assert ChatRenderer(tokenizer, str(jinja)).render(msgs) == "[user:hi]"
    ids = ChatRenderer(tokenizer, None).encode(own)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_renderer_text_parts_and_errors(tokenizer):
    r = ChatRenderer(tokenizer, "chatml")
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]).messages
    assert "a\nb" in r.render(parts)
    image = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]).messages
    with pytest.raises(ValueError, match="not supported"):
        r.render(image)
    cont = r.render(_messages(("user", "q"), ("assistant", "partial")), continue_final_message=True)
    assert cont.rstrip().endswith("partial")
    with pytest.raises(ValueError, match="continue_final_message"):
        r.render(_messages(("user", "q")), continue_final_message=True)
    no_template = types.SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="--chat-template"):
        ChatRenderer(no_template, None).render(_messages(("user", "q")))


def test_usage_counts_prompts_once_per_prompt():
    res = [{"meta_info": {"prompt_tokens": p, "completion_tokens": c, "cached_tokens": k}}
           for p, c, k in [(5, 2, 1), (5, 3, 1), (7, 4, 0), (7, 1, 0)]]
    u = usage(res, n=2, cache_report=True)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (12, 10, 22)
    assert u.prompt_tokens_details.cached_tokens == 1
    assert usage(res, n=2, cache_report=False).prompt_tokens_details is None


def test_openai_logprobs_conversion():
    lp = openai_logprobs(token_logprobs=[[-0.5, 7, "a"]], top_logprobs=[[[-0.5, 7, "a"], [-1.0, 8, "b"]]],
                         input_token_logprobs=[[None, 1, "x"]], input_top_logprobs=[None])
    assert lp.tokens == ["x", "a"] and lp.token_logprobs == [None, -0.5]
    assert lp.top_logprobs == [None, {"a": -0.5, "b": -1.0}] and lp.text_offset == [-1, -1]


def test_json_bytes_is_compact_and_never_writes_nan():
    assert json_bytes({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert json.loads(json_bytes({"x": [-math.inf, 1.5, math.nan]})) == {"x": [None, 1.5, None]}


def test_metrics_collector_names_and_values():
    from sglang.srt.metrics.collector import TokenizerMetrics

    m = TokenizerMetrics("tiny")
    st = types.SimpleNamespace(created=0.0, first_token_time=None, last_token_time=None, stream=True)
    upd = types.SimpleNamespace(new_output_ids=[5], finished_reason=None, prompt_tokens=10,
                                cached_tokens=4, completion_tokens=1)
    m.on_update(st, upd, now=0.5)
    st.first_token_time = st.last_token_time = 0.5
    upd2 = types.SimpleNamespace(new_output_ids=[6, 7], finished_reason={"type": "length"},
                                 prompt_tokens=10, cached_tokens=4, completion_tokens=3)
    m.on_update(st, upd2, now=0.7)
    m.refresh({"max_total_num_tokens": 100, "available_kv_tokens": 60, "cache_evictable_tokens": 10,
               "num_running_reqs": 2, "num_waiting_reqs": 1})
    text = m.render()[0].decode()
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith("sglang:")}
    lbl = '{model_name="tiny"}'
    assert values["sglang:generation_tokens_total" + lbl] == 3
    assert values["sglang:prompt_tokens_total" + lbl] == 10
    assert values["sglang:cache_hit_rate" + lbl] == pytest.approx(0.4)
    assert values["sglang:token_usage" + lbl] == pytest.approx(0.3)
    assert values["sglang:num_queue_reqs" + lbl] == 1
    assert values["sglang:time_to_first_token_seconds_count" + lbl] == 1
    assert values["sglang:inter_token_latency_seconds_sum" + lbl] == pytest.approx(0.1)
    assert values["sglang:time_per_output_token_seconds_sum" + lbl] == pytest.approx(0.1)
