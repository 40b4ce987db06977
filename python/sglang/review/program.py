"""The default review program, and how a record is made from a finished program state."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from sglang.lang.api import assistant, function, gen, system, user

SYSTEM_PROMPT = ("You are a careful legal analyst. Answer the question about the document "
                 "using only the document's text, and quote the clause you rely on.")


@function
def default_program(s, document, question):
    # The document comes first so that every question on it shares the cached prefix.
    s += system(SYSTEM_PROMPT)
    s += user("Document:\n" + document + "\n\nQuestion: " + question)
    s += assistant(gen("answer"))


def _metas(state: Any) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for meta in state.stream_executor.meta_info.values():
        if isinstance(meta, list):
            out += [m for m in meta if isinstance(m, dict)]
        elif isinstance(meta, dict) and "prompt_tokens" in meta:
            out.append(meta)
    return out


def acceptance_of(metas: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Speculative-decoding statistics summed over a program's generations; None when the
    server did not speculate (no spec_* fields in meta_info)."""
    spec = [m for m in metas if "spec_verify_ct" in m]
    if not spec:
        return None
    verify = sum(m.get("spec_verify_ct", 0) for m in spec)
    accepted = sum(m.get("spec_accept_token_num", 0) for m in spec)
    drafted = sum(m.get("spec_draft_token_num", 0) for m in spec)
    completion = sum(m.get("completion_tokens", 0) for m in spec)
    return {"accept_rate": accepted / drafted if drafted else 0.0,
            "accept_length": completion / verify if verify else 0.0,
            "verify_ct": verify, "accepted_tokens": accepted, "draft_tokens": drafted}


def make_record(doc_id: str, doc_sha: str, question_id: str, question: str, state: Any,
                latency_s: float) -> Dict[str, Any]:
    variables = state.variables()
    metas = _metas(state)
    fallbacks = [m["spec_fallback_count"] for m in metas if "spec_fallback_count" in m]
    answer = variables.get("answer")
    if answer is None and variables:
        answer = list(variables.values())[-1]
    record: Dict[str, Any] = {
        "doc_id": doc_id, "doc_sha": doc_sha, "question_id": question_id,
        "question": question, "answer": answer,
        "prompt_tokens": sum(m.get("prompt_tokens", 0) for m in metas),
        "completion_tokens": sum(m.get("completion_tokens", 0) for m in metas),
        "cached_tokens": sum(m.get("cached_tokens", 0) for m in metas),
        "finish_reason": metas[-1].get("finish_reason") if metas else None,
        "latency_s": round(latency_s, 4),
        "acceptance": acceptance_of(metas),
        "fallback_events": sum(fallbacks) if fallbacks else None,
    }
    if set(variables) - {"answer"}:
        record["variables"] = variables
    return record
