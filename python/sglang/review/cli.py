"""`python -m sglang.review`: the command line of the batch legal-document review job.

    python -m sglang.review --docs FOLDER|FILE.jsonl (--questions Q.txt | --program prog.py)
        --out results.jsonl [--server URL [--api-key KEY] | --model-path PATH [engine flags]]

Without --server, an in-process Engine is started; every flag this parser does not know
is passed to it (the `launch_server` flags: --dtype, --speculative-algorithm, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, List, Optional, Tuple

from sglang.review.inputs import load_documents, load_program, load_questions
from sglang.review.runner import ReviewJob, ReviewOptions
from sglang.review.store import ResultStore
from sglang.review.summary import format_summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.review", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", required=True, help="folder of .txt/.md(/.pdf), or JSONL {id, text}")
    p.add_argument("--questions", help="one question per line, or JSONL {id, question}")
    p.add_argument("--program", help="Python file defining `program(s, document, question)`")
    p.add_argument("--out", required=True, help="results JSONL (appended to; resumable)")
    p.add_argument("--summary", help="summary JSON path (default: next to --out)")
    p.add_argument("--server", help="base URL of a running server (else: in-process Engine)")
    p.add_argument("--api-key", help="bearer key for --server")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--parallel", type=int, default=4,
                   help="questions of one document in flight at once")
    p.add_argument("--max-doc-chars", type=int, help="cut each document (quick runs)")
    p.add_argument("--no-warm", action="store_true", help="do not prefill documents first")
    p.add_argument("--no-progress", action="store_true")
    return p


def summary_path(out: str, given: Optional[str]) -> str:
    if given:
        return given
    stem = out[:-len(".jsonl")] if out.endswith(".jsonl") else out
    return stem + ".summary.json"


def make_backend(args: argparse.Namespace, engine_argv: List[str]) -> Tuple[Any, Any]:
    """(backend, closer)."""
    if args.server:
        if engine_argv:
            raise SystemExit(f"unknown arguments with --server: {' '.join(engine_argv)}")
        from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint(args.server, api_key=args.api_key), None
    if not any(a in ("--model-path", "--model") or a.startswith(("--model-path=", "--model="))
               for a in engine_argv):
        raise SystemExit("give --server URL, or --model-path PATH for an in-process engine")
    from sglang.lang.backend.engine_backend import EngineBackend
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(engine_argv)
    if not any(a.startswith("--log-level") for a in engine_argv):
        server_args.log_level = "error"
    engine = Engine(server_args=server_args)
    return EngineBackend(engine), engine.shutdown


def main(argv: Optional[List[str]] = None) -> int:
    args, engine_argv = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if not args.questions and not args.program:
        raise SystemExit("give --questions, or --program (optionally with --questions)")
    documents = load_documents(args.docs, args.max_doc_chars)
    if args.program:
        program, questions = load_program(args.program)
        if args.questions:
            questions = load_questions(args.questions)
    else:
        from sglang.review.program import default_program

        program, questions = default_program, load_questions(args.questions)
    store = ResultStore(args.out)  # before the engine starts: fail fast on a locked file
    backend, closer = make_backend(args, engine_argv)
    try:
        options = ReviewOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                parallel=args.parallel, warm=not args.no_warm,
                                progress=not args.no_progress)
        summary = ReviewJob(program, backend, documents, questions, store, options).run()
    finally:
        store.close()
        if closer is not None:
            closer()
    path = summary_path(args.out, args.summary)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)
    print(format_summary(summary))
    print(f"results: {args.out}; summary: {path}")
    return 0 if summary["complete"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
