"""The review job's parts without a model: the kill-safe results store, inputs, records,
summary, and the corpus builder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang.review.inputs import load_documents, load_program, load_questions
from sglang.review.program import acceptance_of
from sglang.review.store import ResultStore
from sglang.review.summary import format_summary, summarize
from sglang.test.fixtures import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_corpus_builder():
    return load_script("build_legal_corpus")


def rec(doc, q, **kw):
    return {"doc_id": doc, "question_id": q, "question": q, "answer": "a", **kw}


def test_store_cuts_a_partial_last_line_and_never_duplicates(tmp_path):
    path = str(tmp_path / "out.jsonl")
    store = ResultStore(path)
    assert store.append(rec("d", "q1")) and store.append(rec("d", "q2"))
    assert not store.append(rec("d", "q1"))  # already done: nothing written
    store.close()
    with open(path, "ab") as f:
        f.write(b'{"doc_id": "d", "question_id": "q3", "ans')  # a kill mid-write
    store = ResultStore(path)
    assert sorted(store.done) == [("d", "q1"), ("d", "q2")]
    assert store.append(rec("d", "q3"))
    store.close()
    lines = open(path, "rb").read().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["question_id"] for x in lines[:-1]] == ["q1", "q2", "q3"]


def test_store_refuses_a_second_writer_and_corrupt_lines(tmp_path):
    path = str(tmp_path / "out.jsonl")
    first = ResultStore(path)
    code = (f"import sys; sys.path.insert(0, {os.path.join(REPO, 'python')!r}); "
            f"from sglang.review.store import ResultStore; ResultStore({path!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "another review job" in proc.stderr
    first.close()
    with open(path, "w") as f:
        f.write("not json\n")
    with pytest.raises(SystemExit, match="not a JSON record"):
        ResultStore(path)


def test_inputs(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("B text")
    (docs / "sub" / "a.md").write_text("A text")
    (docs / "skip.bin").write_text("x")
    assert [(d.doc_id, d.text) for d in load_documents(str(docs))] == [
        ("b.txt", "B text"), ("sub/a.md", "A text")]
    jl = tmp_path / "docs.jsonl"
    jl.write_text(json.dumps({"id": "x", "text": "hello"}) + "\n" + json.dumps({"text": "t"}) + "\n")
    assert [d.doc_id for d in load_documents(str(jl), max_chars=2)] == ["x", "doc-00002"]
    qs = tmp_path / "q.txt"
    qs.write_text("# comment\nFirst?\n\nSecond?\n")
    assert [(q.question_id, q.text) for q in load_questions(str(qs))] == [("q1", "First?"), ("q2", "Second?")]
    prog = tmp_path / "prog.py"
    prog.write_text("import sglang as sgl\nQUESTIONS = ['Why?']\n"
                    "@sgl.function\ndef program(s, document, question):\n"
                    "    s += document + question + sgl.gen('answer')\n")
    program, questions = load_program(str(prog))
    assert program.arg_names == ["document", "question"] and questions[0].text == "Why?"


def test_acceptance_and_summary():
    metas = [{"prompt_tokens": 10, "completion_tokens": 9, "spec_verify_ct": 3,
              "spec_accept_token_num": 6, "spec_draft_token_num": 9, "spec_fallback_count": 1}]
    acc = acceptance_of(metas)
    assert acc == {"accept_rate": 6 / 9, "accept_length": 3.0, "verify_ct": 3,
                   "accepted_tokens": 6, "draft_tokens": 9}
    assert acceptance_of([{"prompt_tokens": 1}]) is None
    records = [rec("d", "q1", prompt_tokens=10, cached_tokens=8, completion_tokens=9,
                   latency_s=1.0, acceptance=acc, fallback_events=1),
               rec("d", "q2", prompt_tokens=10, cached_tokens=0, completion_tokens=1,
                   latency_s=3.0, acceptance=None, fallback_events=None)]
    s = summarize(records, expected=3, this_run=1, failed=1, wall_s=2.0, warm_s=0.5, docs=1)
    assert (s["resumed"], s["complete"], s["cache_hit_rate"]) == (1, False, 0.4)
    assert s["accept_rate"] == pytest.approx(6 / 9) and s["fallback_events"] == 1
    text = format_summary(s)
    assert "2/3 records" in text and "acceptance rate 0.67" in text and "incomplete" in text


def test_corpus_builder(tmp_path):
    builder = load_corpus_builder()
    common = tmp_path / "common"
    common.mkdir()
    (common / "GPL-3").write_text("GNU GENERAL PUBLIC LICENSE\n\nPreamble one.\n\nMore text here.\n")
    os.symlink("GPL-3", common / "GPL")
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    (fetched / "gdpr.txt").write_text("Regulation (EU) 2016/679 ...")
    (fetched / "common_GPL-3.txt").write_text("duplicate")
    docs = builder.build(str(tmp_path / "out"), max_chars=45, jsonl=True,
                         common_dir=str(common), fetched_dir=str(fetched))
    assert [d["name"] for d in docs] == ["common_GPL-3", "gdpr"]
    assert docs[0]["text"] == "GNU GENERAL PUBLIC LICENSE\n\nPreamble one.\n"
    loaded = load_documents(str(tmp_path / "out" / "docs"))
    assert [d.doc_id for d in loaded] == ["common_GPL-3.txt", "gdpr.txt"]
    assert len(load_questions(str(tmp_path / "out" / "questions.txt"))) == len(builder.QUESTIONS)
    assert len(load_documents(str(tmp_path / "out" / "docs.jsonl"))) == 2
