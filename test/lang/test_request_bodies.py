"""What RuntimeEndpoint puts on the wire, checked against the contract
(shared/reference/sglang-interface.md, "What RuntimeEndpoint sends"): a stdlib HTTP server
records every request and answers with canned responses."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Dict, List

import pytest

import sglang as sgl
from sglang.lang.ir import REGEX_INT

MODEL = "Qwen/Qwen3-30B-A3B"  # matches no template regex: the "default" template


def gen_body(text: str, **overrides: Any) -> Dict[str, Any]:
    """The documented gen body, in the documented key order."""
    sp = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
          "max_new_tokens": 16, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
          "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
          "regex": None, "json_schema": None}
    sp.update(overrides)
    return {"text": text, "sampling_params": sp}


class Recorder(http.server.BaseHTTPRequestHandler):
    requests: List[Dict[str, Any]] = []
    model_path = MODEL
    fail_next = False

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, payload: Any, status: int = 200, ctype: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> Any:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        self.requests.append({"method": self.command, "path": self.path, "raw": raw,
                              "body": body, "auth": self.headers.get("Authorization")})
        return body

    def do_GET(self) -> None:
        self._record()
        if self.path == "/get_model_info":
            self._send({"model_path": self.model_path, "tokenizer_path": self.model_path,
                        "is_generation": True})
        elif self.path == "/server_info":
            self._send({"version": "0.5.10", "max_total_num_tokens": 1000})
        else:
            self._send({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        body = self._record()
        if self.path == "/flush_cache":
            return self._send(b"Cache flushed.\n", ctype="text/plain")
        if Recorder.fail_next:
            Recorder.fail_next = False
            return self._send({"error": {"message": "bad request: nope"}}, 400)
        meta = {"prompt_tokens": 7, "completion_tokens": 2, "finish_reason": {"type": "length"}}
        if body.get("stream"):
            data = b"".join(b"data: " + json.dumps({"text": t, "meta_info": meta}).encode() + b"\n\n"
                            for t in (" He", " Hello", " Hello!")) + b"data: [DONE]\n\n"
            return self._send(data, ctype="text/event-stream")
        prompts = body.get("text", body.get("input_ids"))
        if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
            # choice i's last token gets logprob -3 + i: the last choice wins
            out = [{"text": "", "meta_info": {**meta, "input_token_logprobs": [
                [None, 5, "x"], [-1.0, 6, ":"], [-3.0 + i, 7 + i, "c"]],
                "output_token_logprobs": []}} for i in range(len(prompts))]
            return self._send(out)
        self._send({"text": " Paris", "meta_info": meta})


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def endpoint(server):
    Recorder.requests = []
    ep = sgl.RuntimeEndpoint(server)
    assert [(r["method"], r["path"]) for r in Recorder.requests] == [("GET", "/get_model_info")]
    assert ep.get_chat_template().name == "default"
    Recorder.requests = []
    return ep


def posts() -> List[Dict[str, Any]]:
    return [r for r in Recorder.requests if r["method"] == "POST"]


def assert_exact(recorded: Dict[str, Any], expected: Dict[str, Any]) -> None:
    """Same fields, same values, same order, same bytes as json.dumps(expected)."""
    assert recorded["body"] == expected
    assert list(recorded["body"]) == list(expected)
    assert list(recorded["body"].get("sampling_params", {})) == list(expected.get("sampling_params", {}))
    assert recorded["raw"] == json.dumps(expected).encode()


def test_gen_with_stop(endpoint):
    @sgl.function
    def qa(s):
        s += "Q: What is the capital of France?\nA:" + sgl.gen("answer", max_tokens=16, stop="\n")

    st = qa.run(backend=endpoint, temperature=0)
    assert st["answer"] == " Paris"
    assert st.get_meta_info("answer")["prompt_tokens"] == 7
    (req,) = posts()
    assert req["path"] == "/generate"
    assert_exact(req, gen_body("Q: What is the capital of France?\nA:", stop="\n"))


def test_gen_run_defaults_logprobs_and_constraints(endpoint):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                           return_text_in_logprobs=True)
        s += sgl.gen_int("n")
        s += sgl.gen("r", regex=r"[0-9]+", max_tokens=4)
        s += sgl.gen("j", json_schema='{"type": "object"}', max_tokens=4)

    prog.run(backend=endpoint, max_new_tokens=32, temperature=0.5, top_p=0.9, stop=["END"])
    common = dict(max_new_tokens=32, temperature=0.5, top_p=0.9)
    x, n, r, j = posts()
    assert_exact(x, {**gen_body("a", **common, stop=["END"]), "return_logprob": True,
                     "logprob_start_len": 0, "top_logprobs_num": 2,
                     "return_text_in_logprobs": True})
    assert_exact(n, gen_body("a Paris", **common, stop=["END", " ", "\n"], regex=REGEX_INT))
    assert_exact(r, gen_body("a Paris Paris", **{**common, "max_new_tokens": 4},
                             stop=["END"], regex="[0-9]+"))
    assert_exact(j, gen_body("a Paris Paris Paris", **{**common, "max_new_tokens": 4},
                             stop=["END"], json_schema='{"type": "object"}'))


def test_stream(endpoint):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("a", max_tokens=16)

    st = prog.run(backend=endpoint, temperature=0, stream=True)
    assert list(st.text_iter("a")) == [" He", "llo", "!"]
    assert st["a"] == " Hello!"
    assert_exact(posts()[0], {**gen_body("Hi"), "stream": True})


def test_select_requests(endpoint):
    @sgl.function
    def prog(s):
        s += "Answer:" + sgl.select("c", choices=[" yes", " no", " maybe"])

    st = prog.run(backend=endpoint)
    assert st["c"] == " maybe"
    first, scoring = posts()
    assert_exact(first, {"text": "Answer:", "sampling_params": {"max_new_tokens": 0}})
    assert_exact(scoring, {"text": ["Answer: yes", "Answer: no", "Answer: maybe"],
                           "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                           "return_logprob": True, "return_text_in_logprobs": True,
                           "logprob_start_len": 5})  # prompt_tokens 7 - 2
    meta = st.get_meta_info("c")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-2.0, -1.5, -1.0])


def test_select_unconditional_asks_for_choice_token_logprobs(endpoint):
    @sgl.function
    def prog(s):
        s += "Answer:" + sgl.select("c", choices=[" yes", " no"],
                                    choices_method=sgl.unconditional_likelihood_normalized)

    prog.run(backend=endpoint).sync()
    third = posts()[2]
    # Upstream's body plus logprob_start_len 0: without it no server returns input logprobs.
    assert_exact(third, {"input_ids": [[6, 7], [6, 8]], "sampling_params": {"max_new_tokens": 0},
                         "return_logprob": True, "logprob_start_len": 0})


def test_fork_caches_the_shared_prefix(endpoint):
    @sgl.function
    def prog(s):
        s += "Tips:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" {i}." + sgl.gen("tip", max_tokens=16)
        forks.join()

    st = prog.run(backend=endpoint, temperature=0)
    assert st["tip"] == [" Paris", " Paris"]
    first, *rest = posts()
    assert_exact(first, {"text": "Tips:", "sampling_params": {"max_new_tokens": 0}})
    assert sorted(r["body"]["text"] for r in rest) == ["Tips: 0.", "Tips: 1."]


def test_run_batch_caches_traced_prefix(endpoint):
    instruction = "You are a contract reviewer. Read the clause and classify its risk level. "

    @sgl.function
    def prog(s, clause):
        s += instruction + "Clause: " + clause + "\nRisk:" + sgl.gen("risk", max_tokens=16)

    prog.run_batch([{"clause": "A"}, {"clause": "B"}], backend=endpoint, temperature=0)
    first, *rest = posts()
    assert_exact(first, {"text": instruction + "Clause: ", "sampling_params": {"max_new_tokens": 0}})
    assert sorted(r["body"]["text"] for r in rest) == [instruction + "Clause: A\nRisk:",
                                                       instruction + "Clause: B\nRisk:"]


def test_admin_calls_auth_and_errors(server):
    Recorder.requests = []
    ep = sgl.RuntimeEndpoint(server, api_key="sk-test")
    assert "Cache flushed" in sgl.flush_cache(ep)
    assert sgl.get_server_info(ep)["version"] == "0.5.10"
    assert [(r["method"], r["path"]) for r in Recorder.requests] == [
        ("GET", "/get_model_info"), ("POST", "/flush_cache"), ("GET", "/server_info")]
    assert all(r["auth"] == "Bearer sk-test" for r in Recorder.requests)

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")

    Recorder.fail_next = True
    st = prog.run(backend=ep)
    assert isinstance(st.error(), RuntimeError) and "nope" in str(st.error())


def test_template_roles_and_stop_strings(server):
    Recorder.model_path = "meta-llama/Llama-3.2-1B-Instruct"
    try:
        Recorder.requests = []
        ep = sgl.RuntimeEndpoint(server)

        @sgl.function
        def chat(s):
            s += sgl.user("Hi")
            s += sgl.assistant(sgl.gen("a", max_tokens=16, stop="\n"))

        chat.run(backend=ep, temperature=0).sync()
        assert_exact(posts()[0], gen_body(
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n", stop=["\n", "<|eot_id|>"]))
    finally:
        Recorder.model_path = MODEL
