"""The review loop: for each document with questions left, warm its prefix once, then run
its questions (in parallel) and append one record per answer.

Resuming is skipping: keys already in the results file are never run again, so a job
killed at any point and started again ends with every record exactly once.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import sys
import time
from typing import Any, Dict, List, Optional

from sglang.lang.tracer import trace_program
from sglang.review.inputs import Document, Question
from sglang.review.program import make_record
from sglang.review.store import ResultStore
from sglang.review.summary import summarize

logger = logging.getLogger(__name__)

PROGRAM_ONLY = Question("program", "")  # the one "question" of a program without one


@dataclasses.dataclass
class ReviewOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    parallel: int = 4  # questions of one document in flight at once
    warm: bool = True
    progress: bool = True


class _Progress:
    """A tqdm bar over records, with running acceptance and fallback counts."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="rec", desc="review", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.accepted = self.drafted = self.fallbacks = 0

    def record(self, rec: Dict[str, Any], doc_index: int, docs: int) -> None:
        acc = rec.get("acceptance")
        if acc:
            self.accepted += acc["accepted_tokens"]
            self.drafted += acc["draft_tokens"]
        self.fallbacks += rec.get("fallback_events") or 0
        postfix = {"doc": f"{doc_index}/{docs}"}
        if self.drafted:
            postfix["accept"] = f"{self.accepted / self.drafted:.2f}"
            postfix["fallbacks"] = self.fallbacks
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class ReviewJob:
    def __init__(self, program: Any, backend: Any, documents: List[Document],
                 questions: Optional[List[Question]], store: ResultStore,
                 options: ReviewOptions) -> None:
        self.program = program
        self.backend = backend
        self.documents = documents
        self.takes_question = "question" in program.arg_names
        if self.takes_question and not questions:
            raise SystemExit("the program takes a question: give --questions (or QUESTIONS)")
        self.questions = questions if self.takes_question else [PROGRAM_ONLY]
        self.store = store
        self.options = options
        self.failed = 0
        self.warm_s = 0.0
        self._check_resumable()

    def _check_resumable(self) -> None:
        """Refuse to mix results of other documents' versions or other question texts."""
        docs = {d.doc_id: d for d in self.documents}
        questions = {q.question_id: q for q in self.questions}
        for (doc_id, qid), rec in self.store.done.items():
            doc, q = docs.get(doc_id), questions.get(qid)
            if doc is not None and rec.get("doc_sha") not in (None, doc.sha):
                raise SystemExit(f"{self.store.path} has results for another version of "
                                 f"{doc_id}; write to a new --out file")
            if q is not None and rec.get("question") != q.text:
                raise SystemExit(f"{self.store.path} has another question under id {qid}; "
                                 "write to a new --out file")

    def run(self) -> Dict[str, Any]:
        t0 = time.perf_counter()
        total = len(self.documents) * len(self.questions)
        done_before = sum((d.doc_id, q.question_id) in self.store.done
                          for d in self.documents for q in self.questions)
        if done_before:
            logger.warning("resuming: %d of %d records already in %s", done_before, total,
                           self.store.path)
        progress = _Progress(total, done_before, self.options.progress)
        written = 0
        try:
            with cf.ThreadPoolExecutor(max(1, self.options.parallel),
                                       thread_name_prefix="review") as pool:
                for i, doc in enumerate(self.documents, 1):
                    pending = [q for q in self.questions
                               if (doc.doc_id, q.question_id) not in self.store.done]
                    if not pending:
                        continue
                    if self.options.warm:
                        self._warm(doc)
                    futures = {pool.submit(self._answer, doc, q): q for q in pending}
                    for fut in cf.as_completed(futures):
                        rec = self._result(fut, doc, futures[fut])
                        if rec is not None and self.store.append(rec):
                            written += 1
                            progress.record(rec, i, len(self.documents))
        finally:
            progress.close()
        records = [self.store.done[(d.doc_id, q.question_id)] for d in self.documents
                   for q in self.questions if (d.doc_id, q.question_id) in self.store.done]
        return summarize(records, total, written, self.failed, time.perf_counter() - t0,
                         self.warm_s, len(self.documents))

    def _warm(self, doc: Document) -> None:
        """Prefill the text every question on `doc` starts with (max_new_tokens 0)."""
        t = time.perf_counter()
        try:
            prefix = trace_program(self.program, {"document": doc.text}, self.backend).prefix
            if prefix:
                self.backend.cache_prefix(prefix)
        except Exception as e:  # noqa: BLE001 - warming is an optimisation only
            logger.warning("warming %s failed: %r", doc.doc_id, e)
        self.warm_s += time.perf_counter() - t

    def _answer(self, doc: Document, q: Question) -> Dict[str, Any]:
        kwargs: Dict[str, Any] = {"document": doc.text}
        if self.takes_question:
            kwargs["question"] = q.text
        t = time.perf_counter()
        state = self.program.run(**kwargs, backend=self.backend,
                                 max_new_tokens=self.options.max_new_tokens,
                                 temperature=self.options.temperature)
        state.sync()
        if state.error() is not None:
            raise state.error()
        return make_record(doc.doc_id, doc.sha, q.question_id, q.text, state,
                           time.perf_counter() - t)

    def _result(self, fut: "cf.Future", doc: Document, q: Question) -> Optional[Dict[str, Any]]:
        try:
            return fut.result()
        except Exception as e:  # noqa: BLE001 - reported; a later run retries it
            self.failed += 1
            logger.error("%s / %s failed: %r", doc.doc_id, q.question_id, e)
            return None
