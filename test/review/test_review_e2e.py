"""`python -m sglang.review` for real: against a server it survives SIGKILL at random
points (several runs) and, resumed, ends with every record exactly once and identical to
an uninterrupted greedy run; a --program file works; the in-process Engine (with n-gram
speculation) gives the same answers and reports acceptance."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

import sglang as sgl
from sglang.test.fixtures import load_script

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": os.path.join(REPO, "python")}
MAX_NEW = "16"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("review") / "server.log")
    runtime = sgl.Runtime(model_path=tiny_llama_dir, dtype="float32", log_file=log)
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Tuple[str, str]:
    """3 real licence texts (cut to ~500 chars) and 2 questions: 6 records."""
    builder = load_script("build_legal_corpus")
    out = tmp_path_factory.mktemp("corpus")
    builder.build(str(out), max_chars=500, max_docs=3, only=["common"])
    questions = out / "q2.txt"
    questions.write_text("\n".join(builder.QUESTIONS[:2]) + "\n")
    return str(out / "docs"), str(questions)


def review_cmd(corpus, out: str, *extra: str) -> List[str]:
    docs, questions = corpus
    return [sys.executable, "-m", "sglang.review", "--docs", docs, "--questions", questions,
            "--out", out, "--max-new-tokens", MAX_NEW, "--parallel", "2", *extra]


def read_records(path: str) -> Dict[Tuple[str, str], dict]:
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.split(b"\n")[:-1]]
    keys = [(r["doc_id"], r["question_id"]) for r in records]
    assert len(keys) == len(set(keys)), "a record was written twice"
    return dict(zip(keys, records))


def same_answers(a: Dict, b: Dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for field in ("answer", "completion_tokens", "prompt_tokens", "finish_reason", "doc_sha"):
            assert a[key][field] == b[key][field], (key, field)


@pytest.fixture(scope="module")
def reference(server, corpus, tmp_path_factory):
    """An uninterrupted greedy run: (records, seconds it took)."""
    out = str(tmp_path_factory.mktemp("ref") / "ref.jsonl")
    t0 = time.time()
    proc = subprocess.run(review_cmd(corpus, out, "--server", server.url), env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "6/6 records over 3 documents" in proc.stdout
    summary = json.load(open(out[:-len(".jsonl")] + ".summary.json"))
    assert summary["complete"] and summary["cached_tokens"] > 0  # questions reused the warm doc
    return read_records(out), time.time() - t0


def test_reference_run(reference):
    records, _ = reference
    assert len(records) == 6
    r = next(iter(records.values()))
    assert r["completion_tokens"] <= int(MAX_NEW) and r["latency_s"] > 0
    assert r["acceptance"] is None and r["fallback_events"] is None


def count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def test_sigkill_at_random_points_then_resume(server, corpus, reference, tmp_path):
    """Each run is killed at a random point: after a random number of new records (0-2)
    plus a random delay (0-0.4 s), so kills land in start-up, warming, requests and writes.
    The first run is killed as soon as its first record lands, so that at least one kill is
    mid-run however fast the machine is."""
    ref, _ = reference
    out = str(tmp_path / "killed.jsonl")
    rng = random.Random(20241130)
    counts = []
    for run in range(4):
        start = count_lines(out)
        target = 1 if run == 0 else min(start + rng.randint(0, 2), 5)
        proc = subprocess.Popen(review_cmd(corpus, out, "--server", server.url), env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while count_lines(out) < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        if run > 0:
            time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        counts.append(count_lines(out))
    # a kill mid-write leaves a partial line; the next run must cut it off
    with open(out, "ab") as f:
        f.write(b'{"doc_id": "common_Apache-2.0.txt", "question_id": "q1", "answ')
    final = subprocess.run(review_cmd(corpus, out, "--server", server.url, "--no-progress"),
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert "dropping a partial last line" in final.stderr
    same_answers(read_records(out), ref)
    assert any(0 < c < 6 for c in counts), f"no kill landed mid-run: {counts}"
    # and once complete, another run does nothing
    again = subprocess.run(review_cmd(corpus, out, "--server", server.url, "--no-progress"),
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "(6 from earlier runs, 0 this run" in again.stdout


def test_program_file(server, corpus, tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import sglang as sgl\n"
        "QUESTIONS = ['Is this a licence?']\n"
        "@sgl.function\n"
        "def program(s, document, question):\n"
        "    s += sgl.user('Text:\\n' + document + '\\nQuestion: ' + question)\n"
        "    s += sgl.assistant('Verdict:' + sgl.select('verdict', choices=[' yes', ' no'])\n"
        "                       + '\\nWhy:' + sgl.gen('answer', max_tokens=8))\n")
    out = str(tmp_path / "prog.jsonl")
    docs, _ = corpus
    proc = subprocess.run([sys.executable, "-m", "sglang.review", "--docs", docs, "--program",
                           str(prog), "--out", out, "--server", server.url, "--no-progress"],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = read_records(out)
    assert len(records) == 3
    for r in records.values():
        assert r["variables"]["verdict"] in (" yes", " no") and r["answer"] == r["variables"]["answer"]


def test_in_process_engine_with_speculation(corpus, reference, tiny_llama_dir, tmp_path):
    ref, _ = reference
    out = str(tmp_path / "engine.jsonl")
    proc = subprocess.run(review_cmd(corpus, out, "--model-path", tiny_llama_dir, "--dtype",
                                     "float32", "--speculative-algorithm", "NGRAM"),
                          env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    records = read_records(out)
    same_answers(records, ref)  # speculation is lossless and the engine is the server's
    assert all(r["acceptance"] is not None for r in records.values())
    assert "speculation: acceptance rate" in proc.stdout
    assert "accept=" in proc.stderr  # the progress bar shows running acceptance
