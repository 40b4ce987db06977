"""What a review job reads: documents, questions, and optionally a DSL program."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from typing import Any, List, Optional, Tuple

_TEXT_SUFFIXES = (".txt", ".md")


@dataclasses.dataclass
class Document:
    doc_id: str  # file path relative to the folder, or the JSONL record's id
    text: str

    @property
    def sha(self) -> str:
        """Short content hash: a resumed job refuses results of a changed document."""
        return hashlib.sha1(self.text.encode("utf-8")).hexdigest()[:12]


@dataclasses.dataclass
class Question:
    question_id: str
    text: str


def _read_pdf(path: str) -> str:
    try:
        import pypdf
    except ImportError:
        raise SystemExit(f"{path}: reading PDFs needs the pypdf package (pip install pypdf)")
    return "\n".join(page.extract_text() or "" for page in pypdf.PdfReader(path).pages)


def load_documents(path: str, max_chars: Optional[int] = None) -> List[Document]:
    """A folder (every .txt / .md, and .pdf with pypdf, recursively, sorted by path) or a
    JSONL file of {"id", "text"} records. `max_chars` cuts each text (for quick runs)."""
    docs: List[Document] = []
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for name in files:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, path)
                if name.lower().endswith(_TEXT_SUFFIXES):
                    with open(full, encoding="utf-8", errors="replace") as f:
                        docs.append(Document(rel, f.read()))
                elif name.lower().endswith(".pdf"):
                    docs.append(Document(rel, _read_pdf(full)))
        docs.sort(key=lambda d: d.doc_id)
    elif os.path.isfile(path) and path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                rec = json.loads(line)
                text = rec.get("text", rec.get("content"))
                if not isinstance(text, str):
                    raise SystemExit(f"{path}:{i + 1}: each record needs a string 'text'")
                doc_id = str(rec.get("id", rec.get("doc_id", f"doc-{i + 1:05d}")))
                docs.append(Document(doc_id, text))
    elif os.path.isfile(path) and path.lower().endswith(_TEXT_SUFFIXES + (".pdf",)):
        text = _read_pdf(path) if path.lower().endswith(".pdf") else open(path, encoding="utf-8").read()
        docs.append(Document(os.path.basename(path), text))
    else:
        raise SystemExit(f"--docs {path}: not a folder, a JSONL file or a text document")
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"--docs {path}: document ids are not unique")
    if not docs:
        raise SystemExit(f"--docs {path}: no documents found (.txt, .md, .pdf or JSONL)")
    if max_chars:
        for d in docs:
            d.text = d.text[:max_chars]
    return docs


def load_questions(path: str) -> List[Question]:
    """One question per line (blank lines and lines starting with # are skipped; ids are
    q1, q2, ... in order), or JSONL records {"id", "question"}."""
    questions: List[Question] = []
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for i, line in enumerate(f):
                if line.strip():
                    rec = json.loads(line)
                    questions.append(Question(str(rec.get("id", f"q{i + 1}")), rec["question"]))
        else:
            for line in f:
                text = line.strip()
                if text and not text.startswith("#"):
                    questions.append(Question(f"q{len(questions) + 1}", text))
    if not questions:
        raise SystemExit(f"--questions {path}: no questions found")
    if len({q.question_id for q in questions}) != len(questions):
        raise SystemExit(f"--questions {path}: question ids are not unique")
    return questions


def load_program(path: str) -> Tuple[Any, Optional[List[Question]]]:
    """A Python file that defines `program` (an @sgl.function taking `document` and,
    optionally, `question`) and optionally `QUESTIONS` (a list of strings)."""
    from sglang.lang.ir import SglFunction

    spec = importlib.util.spec_from_file_location("sglang_review_program", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--program {path}: cannot load it as a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    program = getattr(module, "program", None)
    if program is None:
        found = [v for v in vars(module).values() if isinstance(v, SglFunction)]
        if len(found) != 1:
            raise SystemExit(f"--program {path}: define `program = ...` (an @sgl.function)")
        program = found[0]
    if not isinstance(program, SglFunction):
        program = SglFunction(program)
    if "document" not in program.arg_names:
        raise SystemExit(f"--program {path}: the program needs a `document` parameter")
    questions = getattr(module, "QUESTIONS", None)
    if questions is not None:
        questions = [Question(f"q{i + 1}", str(q)) for i, q in enumerate(questions)]
    return program, questions
