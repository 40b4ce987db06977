"""Checks at the front door: the types of a /generate request's top-level fields, and the
error a refused request becomes (HTTP 400 for what the client must change, 503 / 500 when
the engine refused it for load or health)."""

from __future__ import annotations

from typing import Any, Dict, List

from sglang.srt.managers.io_struct import GenerateReqInput


class RequestRefused(RuntimeError):
    """The engine refused or dropped a request (queue full, shutting down, scheduler gone)."""

    def __init__(self, message: str, status_code: int = 503) -> None:
        super().__init__(message)
        self.status_code = status_code


def raise_if_refused(out: Dict[str, Any]) -> None:
    """A final output whose finish reason is an abort with a status code becomes an error:
    400 -> ValueError, others (503 queue full, 500) -> RequestRefused."""
    reason = out["meta_info"].get("finish_reason")
    if not isinstance(reason, dict) or reason.get("type") != "abort":
        return
    status = reason.get("status_code")
    if status == 400:
        raise ValueError(reason.get("message", "Bad request."))
    if status is not None:
        raise RequestRefused(reason.get("message", "The request was refused."), int(status))


_MAX_N = 1024


def check_request_types(obj: GenerateReqInput) -> None:
    """Type checks for the top-level /generate fields that split() takes on trust, so a
    wrong type is a 400 with a message instead of a crash or a silent coercion."""

    def each(value: Any) -> List[Any]:
        return value if isinstance(value, list) else [value]

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    for name in ("stream", "return_text_in_logprobs"):
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(obj, name)!r}")
    if not all(isinstance(v, bool) for v in each(obj.return_logprob)):
        raise ValueError(f"return_logprob must be a boolean (or a list of them), got {obj.return_logprob!r}")
    for name in ("logprob_start_len", "top_logprobs_num"):
        value = getattr(obj, name)
        if value is not None and not all(v is None or is_int(v) for v in each(value)):
            raise ValueError(f"{name} must be an integer (or a list of them), got {value!r}")
    if obj.top_logprobs_num is not None and any(v is not None and v < 0 for v in each(obj.top_logprobs_num)):
        raise ValueError(f"top_logprobs_num must be non-negative, got {obj.top_logprobs_num!r}")
    if obj.rid is not None and not all(isinstance(r, str) for r in each(obj.rid)):
        raise ValueError(f"rid must be a string (or a list of strings), got {obj.rid!r}")
    sps = obj.sampling_params
    for sp in each(sps) if sps is not None else []:
        if not isinstance(sp, dict):
            raise ValueError("sampling_params must be an object (or a list of objects for a batch).")
        n = sp.get("n", 1)
        if n is not None and (not is_int(n) or not 1 <= n <= _MAX_N):
            raise ValueError(f"n must be an integer between 1 and {_MAX_N}, got {n!r}")
