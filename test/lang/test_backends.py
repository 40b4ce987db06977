"""The same DSL programs on the real HTTP server (a `sgl.Runtime` child process) and on an
in-process Engine give the same greedy results: multi-turn chat, select (all three
scoring methods), fork/join, run_batch, gen with stop, streaming. One server and one
engine for the whole module (each start costs ~15-20 s here)."""

from __future__ import annotations

import os
import re

import pytest

import sglang as sgl

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


@pytest.fixture(scope="module")
def http_backend(tiny_llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("lang") / "server.log")
    runtime = sgl.Runtime(model_path=tiny_llama_dir, dtype="float32", log_file=log)
    yield runtime.endpoint
    runtime.shutdown()


@pytest.fixture(scope="module")
def engine_backend(tiny_llama_dir):
    backend = sgl.EngineBackend(model_path=tiny_llama_dir, dtype="float32")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def backends(http_backend, engine_backend):
    return {"http": http_backend, "engine": engine_backend}


def on_both(backends, program, **kwargs):
    return {name: program.run(backend=be, temperature=0, **kwargs)
            for name, be in backends.items()}


@sgl.function
def multi_turn(s, question):
    s += sgl.system("You review contracts.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("first", max_tokens=12))
    s += sgl.user("Quote the clause.")
    s += sgl.assistant(sgl.gen("second", max_tokens=12))


def test_chat_template_is_the_models_own(backends, tiny_llama_dir):
    import jinja2

    with open(os.path.join(tiny_llama_dir, "chat_template.jinja")) as f:
        jinja = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(f.read())
    for be in backends.values():
        t = be.get_chat_template()
        for msgs in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]):
            assert t.get_prompt(msgs) == jinja.render(messages=msgs, add_generation_prompt=True)


def test_multi_turn_chat(backends):
    out = on_both(backends, multi_turn, question="Who may terminate this licence?")
    http, engine = out["http"], out["engine"]
    assert http.error() is None and engine.error() is None
    assert http.text() == engine.text()
    assert http.messages() == engine.messages()
    assert [m["role"] for m in http.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert http.get_meta_info("second")["completion_tokens"] == 12


@sgl.function
def choose(s, clause):
    s += "Clause: " + clause + "\nRisk level:"
    s += sgl.select("risk", choices=[" low", " medium", " high"])
    s += "\nParty:" + sgl.select("party", choices=[" buyer", " seller"],
                                 choices_method=sgl.greedy_token_selection)
    s += "\nFair:" + sgl.gen("fair", choices=[" yes", " no", " unclear"],
                             choices_method=sgl.unconditional_likelihood_normalized)


def test_select(backends):
    out = on_both(backends, choose, clause="The seller may end this agreement at any time.")
    for name in ("risk", "party", "fair"):
        a, b = out["http"].get_meta_info(name), out["engine"].get_meta_info(name)
        assert out["http"][name] == out["engine"][name]
        assert a["normalized_prompt_logprobs"] == pytest.approx(b["normalized_prompt_logprobs"], abs=1e-4)
    assert out["http"]["risk"] in (" low", " medium", " high")
    meta = out["http"].get_meta_info("risk")
    # the winner has the best mean logprob over its tokens
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert [" low", " medium", " high"][best] == out["http"]["risk"]
    assert out["http"].text() == out["engine"].text()


@sgl.function
def parallel(s, join_mode):
    s += "Three obligations of a licensee:\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("item", max_tokens=8, stop="\n")
    forks.join(join_mode)
    s += "\nSummary:" + sgl.gen("summary", max_tokens=8)


@pytest.mark.parametrize("mode", ["gather_variable", "concate_and_append"])
def test_fork_join(backends, mode):
    out = on_both(backends, parallel, join_mode=mode)
    assert out["http"].error() is None, out["http"].error()
    assert out["http"].text() == out["engine"].text()
    if mode == "gather_variable":
        items = out["http"]["item"]
        assert len(items) == 3 and items == out["engine"]["item"]
    else:
        assert "1." in out["http"].text() and "3." in out["http"].text()


def test_run_batch_matches_single_runs(backends):
    questions = [{"question": q} for q in ("Who pays?", "When does it end?",
                                           "Which law applies?", "Can it be assigned?")]
    texts = {}
    for name, be in backends.items():
        states = multi_turn.run_batch(questions, backend=be, temperature=0, num_threads=4)
        texts[name] = [s.text() for s in states]
    assert texts["http"] == texts["engine"]
    single = multi_turn.run(question="When does it end?", backend=backends["http"], temperature=0)
    assert single.text() == texts["http"][1]


@sgl.function
def continue_text(s, stop_at):
    s += "This Agreement shall be governed by"
    s += sgl.gen("rest", max_tokens=24, stop=stop_at)


def test_gen_with_stop(backends):
    free = continue_text.run(stop_at=None, backend=backends["http"], temperature=0)["rest"]
    stop = free[10:14]  # any piece of the free continuation
    cut = free[:free.find(stop)]
    out = on_both(backends, continue_text, stop_at=stop)
    for state in out.values():
        assert state["rest"] == cut
        assert state.get_meta_info("rest")["finish_reason"]["type"] == "stop"


def test_stream_gives_the_same_text(backends):
    for be in backends.values():
        streamed = multi_turn.run(question="Is there a warranty?", backend=be, temperature=0,
                                  stream=True)
        pieces = list(streamed.text_iter())
        plain = multi_turn.run(question="Is there a warranty?", backend=be, temperature=0)
        assert len(pieces) > 5 and "".join(pieces) == plain.text()


def test_admin_calls(backends):
    for be in backends.values():
        info = sgl.get_server_info(be)
        assert isinstance(info["max_total_num_tokens"], int)
        assert sgl.flush_cache(be)


@sgl.function
def constrained(s):
    s += "Year of the agreement: " + sgl.gen("year", max_tokens=6, regex=r"(19|20)[0-9]{2}")
    s += "\nClauses: " + sgl.gen_int("count", max_tokens=4)
    s += "\nJSON: " + sgl.gen("obj", max_tokens=24, json_schema={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})


@pytest.mark.parametrize("name", ["http", "engine"])
def test_constrained_generation(backends, name):
    """regex, gen_int and json_schema as the DSL sends them are honoured by the engine."""
    import json

    st = constrained.run(backend=backends[name], temperature=0)
    assert re.fullmatch(r"(19|20)[0-9]{2}", st["year"])
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", st["count"] + " ")
    assert json.loads(st["obj"])["ok"] in (True, False)
