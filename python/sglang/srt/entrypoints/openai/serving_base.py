"""What the OpenAI handlers share: errors, request parsing, sampling params, usage, logprobs,
and waiting for a result while watching for the client to go away."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from typing import Any, Awaitable, Dict, List, Optional, Type, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from sglang.srt.entrypoints.json_body import loads_body
from sglang.srt.entrypoints.openai.protocol import (ErrorResponse, LogProbs, PromptTokensDetails,
                                                    UsageInfo)
from sglang.srt.managers.request_checks import RequestRefused

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_ERR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
              413: "RequestTooLargeError", 500: "InternalServerError",
              503: "ServiceUnavailableError"}


class ClientDisconnected(Exception):
    pass


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON as upstream's orjson writes it: non-finite floats become null."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def error_object(message: str, status: int = 400, err_type: Optional[str] = None,
                 param: Optional[str] = None) -> Dict[str, Any]:
    return ErrorResponse(message=message, type=err_type or _ERR_TYPES.get(status, "Error"),
                         param=param, code=status).model_dump()


def openai_error(message: str, status: int = 400, err_type: Optional[str] = None) -> JSONResponse:
    """OpenAI's flat error object, as upstream SGLang sends it."""
    return JSONResponse(error_object(message, status, err_type), status_code=status)


def streaming_error(message: str, status: int = 400) -> str:
    return f"data: {json.dumps({'error': error_object(message, status)})}\n\n"


def error_for(exc: BaseException) -> JSONResponse:
    """Map what the tokenizer manager raises to the OpenAI error the client sees."""
    if isinstance(exc, ValueError):
        return openai_error(str(exc), 400)
    if isinstance(exc, RequestRefused):
        return openai_error(str(exc), exc.status_code)
    logger.exception("Internal error while serving a request")
    return openai_error(f"Internal server error: {exc}", 500)


async def parse_body(request: Request, model: Type[M]) -> M:
    """The JSON body as `model`; raises ValueError (-> 400) with a readable message."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ValueError("Unsupported Media Type: Only 'application/json' is allowed")
    raw = await request.body()
    body = loads_body(raw)
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        parts = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"{e.error_count()} validation error(s): " + "; ".join(parts)) from None


async def until_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`, cancelling it (which aborts the engine request) if the client
    disconnects first; then raises ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def load_generation_defaults(model_path: str) -> Dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (`--sampling-defaults
    model`); used for chat fields the request leaves unset."""
    path = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else None
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def sampling_params(req: Any, max_new_tokens: Optional[int], stop: Any,
                    defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The /generate sampling_params for an OpenAI request (unset fields keep the engine's
    defaults, or the model's generation config where given)."""
    defaults = defaults or {}
    sp: Dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens, "stop": stop,
        "stop_token_ids": req.stop_token_ids, "stop_regex": req.stop_regex, "n": req.n,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "regex": req.regex, "ebnf": req.ebnf, "no_stop_trim": req.no_stop_trim,
        "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "logit_bias": req.logit_bias, "custom_params": req.custom_params,
        "sampling_seed": req.seed,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name, None)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            sp[name] = value
    json_schema = getattr(req, "json_schema", None)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema field")
        json_schema = json.dumps(fmt.json_schema.schema_ or {})
    elif fmt is not None and fmt.type == "json_object":
        json_schema = '{"type": "object"}'
    if json_schema is not None:
        sp["json_schema"] = json_schema
    return sp


def usage(results: List[Dict[str, Any]], n: int, cache_report: bool) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample); completions add up."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for i, r in enumerate(results) if i % n == 0)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    details = None
    if cache_report:
        cached = sum(r["meta_info"].get("cached_tokens", 0) for i, r in enumerate(results)
                     if i % n == 0)
        details = PromptTokensDetails(cached_tokens=cached)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=details)


def openai_logprobs(token_logprobs: Optional[List[List[Any]]] = None,
                    top_logprobs: Optional[List[Any]] = None,
                    input_token_logprobs: Optional[List[List[Any]]] = None,
                    input_top_logprobs: Optional[List[Any]] = None) -> LogProbs:
    """SGLang's [logprob, id, text] lists -> the completions API's LogProbs."""
    out = LogProbs()
    for entries in (input_token_logprobs, token_logprobs):
        for lp, _tok, text in entries or []:
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.text_offset.append(-1)  # not computed, as upstream
    for positions in (input_top_logprobs, top_logprobs):
        for pos in positions or []:
            if pos is None:
                out.top_logprobs.append(None)
                continue
            entry: Dict[str, float] = {}
            for lp, _tok, text in pos:
                entry.setdefault(text, lp)  # keep the best of tokens with equal text
            out.top_logprobs.append(entry)
    return out


def finish_fields(meta: Dict[str, Any]) -> Dict[str, Any]:
    reason = meta.get("finish_reason")
    if not reason:
        return {"finish_reason": None, "matched_stop": None}
    return {"finish_reason": reason["type"], "matched_stop": reason.get("matched")}
