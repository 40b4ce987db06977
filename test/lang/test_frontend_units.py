"""The frontend without a model: sampling-option resolution, expressions, chat templates,
tracing, and the interpreter's semantics (forks, errors, streaming, batches) on an
in-memory backend that answers /generate bodies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import sglang as sgl
from sglang.lang.backend.srt_backend import SrtBackend
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import REGEX_INT, SglExprList, SglSamplingParams, SglSelect
from sglang.lang.tracer import trace_program


class EchoBackend(SrtBackend):
    """Completions are "<n>" where n counts the gen requests so far; streams in 2 pieces."""

    def __init__(self, template: str = "default", delay: float = 0.0) -> None:
        self.chat_template = get_chat_template(template)
        self.bodies = []
        self.delay = delay
        self._lock = threading.Lock()

    def _post(self, body):
        with self._lock:
            self.bodies.append(body)
            n = len(self.bodies)
        time.sleep(self.delay)
        if isinstance(body.get("text"), list):
            return [{"text": "", "meta_info": {"prompt_tokens": 5, "input_token_logprobs":
                     [[None, 0, "x"], [-1.0, 1, "y"], [-0.1 * (i + 1), 2, c]],
                     "output_token_logprobs": []}} for i, c in enumerate(body["text"])]
        if body["sampling_params"].get("max_new_tokens") == 0:
            return {"text": "", "meta_info": {"prompt_tokens": 5}}
        if body["sampling_params"].get("n", 1) > 1:
            return [{"text": f"<{n}.{k}>", "meta_info": {}} for k in range(body["sampling_params"]["n"])]
        return {"text": f"<{n}>", "meta_info": {"prompt_tokens": 5, "completion_tokens": 1}}

    def _post_stream(self, body):
        self.bodies.append(body)
        for text in ("ab", "abcd"):
            yield {"text": text, "meta_info": {}}

    def gen_bodies(self):
        return [b for b in self.bodies if b["sampling_params"].get("max_new_tokens") != 0]


def test_import_is_light():
    code = ("import sys, sglang as sgl; sgl.function; sgl.gen; "
            "assert 'torch' not in sys.modules and 'requests' not in sys.modules")
    root = os.path.dirname(os.path.dirname(os.path.abspath(sgl.__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_sampling_params_resolution():
    ex = StreamExecutor(EchoBackend("chatml"), {}, SglSamplingParams(max_new_tokens=64, stop=[],
                                                                     temperature=0))
    p = ex.resolve_sampling_params(sgl.gen("x", max_tokens=8, stop="\n").sampling_params)
    assert (p.max_new_tokens, p.temperature, p.stop) == (8, 0, ["\n", "<|im_end|>"])
    p = ex.resolve_sampling_params(sgl.gen_int("n").sampling_params)
    assert p.regex == REGEX_INT and p.stop == ["<|im_end|>", " ", "\n"]
    assert ex.default_sampling_params.stop == []  # resolution never mutates the defaults
    kw = SglSamplingParams().to_srt_kwargs()
    assert list(kw) == ["max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids",
                        "stop_regex", "temperature", "top_p", "top_k", "min_p",
                        "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
                        "json_schema"]
    assert kw["stop"] == [] and kw["stop_token_ids"] == []


def test_expressions_and_functions():
    e = "Q: " + sgl.gen("a") + "\n"
    assert isinstance(e, SglExprList) and len(e.expr_list) == 3
    assert isinstance(sgl.gen("c", choices=["x", "y"]), SglSelect)
    assert json.loads(sgl.gen("j", json_schema={"type": "object"}).sampling_params.json_schema)
    with pytest.raises(ValueError):
        sgl.gen("r", regex="(")
    with pytest.raises(ValueError):
        sgl.function(lambda x: None)

    @sgl.function
    def f(s, a, b="B"):
        s += a + b

    assert f.bind(a="A").arguments((), {}) == {"a": "A"}
    with pytest.raises(TypeError):
        f.arguments((), {})
    with pytest.raises(TypeError):
        f.bind(zzz=1)


def test_chat_template_by_model_path(tmp_path):
    assert get_chat_template_by_model_path("meta-llama/Llama-3.2-1B-Instruct").name == "llama-3-instruct"
    assert get_chat_template_by_model_path("Qwen/Qwen2.5-7B-Instruct").name == "qwen"
    assert get_chat_template_by_model_path("Qwen/Qwen3-30B-A3B").name == "default"
    (tmp_path / "chat_template.jinja").write_text(
        "{{ '<|im_start|>system\nYou are Bob.<|im_end|>\n' }}{{'<|im_start|>' + m }}")
    t = get_chat_template_by_model_path(str(tmp_path))
    assert t.name == "chatml" and t.default_system_prompt == "You are Bob."
    assert t.get_prompt([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are Bob.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tracing_finds_the_constant_prefix():
    @sgl.function
    def prog(s, document, question, style="plain"):
        s += sgl.system("Be " + style)
        s += sgl.user(f"Doc: {document.strip()}\nQ: {question}")
        s += sgl.assistant(sgl.gen("answer"))

    t = trace_program(prog, {"document": " D "}, EchoBackend())
    assert t.prefix == "SYSTEM:Be plain\nUSER:Doc: D\nQ: " and not t.complete
    assert trace_program(prog, {}, EchoBackend()).prefix == "SYSTEM:Be plain\nUSER:Doc: "


def test_multi_turn_messages_and_variables():
    be = EchoBackend()

    @sgl.function
    def chat(s):
        s += sgl.system("sys")
        s += sgl.user("u1")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))
        with s.user():
            s += "u2"
        s += sgl.assistant_begin() + sgl.gen("a", max_tokens=4) + sgl.assistant_end()

    st = chat.run(backend=be, temperature=0)
    assert st.text() == "SYSTEM:sys\nUSER:u1\nASSISTANT:<1>\nUSER:u2\nASSISTANT:<2>\n"
    assert st["a"] == "<2>"  # a re-generated variable holds the newest value
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert be.gen_bodies()[1]["text"] == "SYSTEM:sys\nUSER:u1\nASSISTANT:<1>\nUSER:u2\nASSISTANT:"


def test_fork_join_modes():
    be = EchoBackend()

    @sgl.function
    def prog(s):
        s += "Base."
        forks = s.fork(2)
        forks += [" x", " y"]
        forks += sgl.gen("g", max_tokens=2)
        assert sorted(f["g"] for f in forks) == ["<2>", "<3>"]
        forks.join()
        more = s.fork(2)
        for i, f in enumerate(more):
            f += f"[{i}]"
        more.join("concate_and_append")
        s += "!"

    st = prog.run(backend=be)
    assert st.error() is None
    assert sorted(st["g"]) == ["<2>", "<3>"]
    assert st.text() == "Base.[0][1]!"
    assert be.bodies[0] == {"text": "Base.", "sampling_params": {"max_new_tokens": 0}}


def test_errors_surface_in_state():
    class Failing(EchoBackend):
        def _post(self, body):
            raise RuntimeError("server said no")

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")
        s += sgl.gen("b")  # queued after the failure: must not leave readers waiting

    st = prog.run(backend=Failing())
    assert isinstance(st.error(), RuntimeError)
    for name in ("a", "b"):
        with pytest.raises(RuntimeError, match="not produced"):
            st[name]
    with pytest.raises(RuntimeError, match="has ended"):
        st += "more"


def test_stream_text_iter():
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=4) + "."

    st = prog.run(backend=EchoBackend(), stream=True)
    assert list(st.text_iter("a")) == ["ab", "cd"]
    assert "".join(prog.run(backend=EchoBackend(), stream=True).text_iter()) == "Q:abcd."
    assert prog.run(backend=EchoBackend()).text() == "Q:<1>."


def test_run_batch_order_threads_and_precache():
    be = EchoBackend(delay=0.05)

    @sgl.function
    def prog(s, i):
        s += "A long constant instruction that every program starts with, " * 2
        s += str(i) + sgl.gen("a", max_tokens=2)

    t0 = time.time()
    states = prog.run_batch([{"i": i} for i in range(8)], num_threads=8, backend=be)
    assert time.time() - t0 < 8 * 0.05 + 0.3  # ran concurrently
    assert [s.text().split(", ")[-1][:1] for s in states] == [str(i) for i in range(8)]
    assert be.bodies[0]["sampling_params"] == {"max_new_tokens": 0}  # traced prefix cached
    assert be.bodies[0]["text"].startswith("A long constant")
    gen_states = list(prog.run_batch([(i,) for i in range(3)], backend=be, generator_style=True))
    assert len(gen_states) == 3


def test_gen_n_samples_and_default_backend():
    be = EchoBackend()
    sgl.set_default_backend(be)
    try:
        @sgl.function
        def prog(s):
            s += "x" + sgl.gen("a", n=2)

        st = prog.run()
        assert st["a"] == ["<1.0>", "<1.1>"] and st.text() == "x"
    finally:
        sgl.global_config.default_backend = None
