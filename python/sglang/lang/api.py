"""The public functions of the frontend language (re-exported as `sglang.*`)."""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Union

from sglang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sglang.lang.global_config import global_config
from sglang.lang.ir import (SglExpr, SglExprList, SglFunction, SglGen, SglRoleBegin, SglRoleEnd,
                            SglSamplingParams, SglSelect, as_expr, json_schema_str)


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """`@sgl.function` or `@sgl.function(num_api_spec_tokens=...)`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend: Any) -> None:
    """Backend for programs run without `backend=`: a RuntimeEndpoint, a Runtime, an
    EngineBackend or an `sglang.Engine`."""
    from sglang.lang.run import resolve_backend

    global_config.default_backend = resolve_backend(backend)


def flush_cache(backend: Any = None):
    from sglang.lang.run import resolve_backend

    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None):
    from sglang.lang.run import resolve_backend

    return resolve_backend(backend).get_server_info()


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None, n: Optional[int] = None,
        stop: Optional[Union[str, List[str]]] = None, stop_token_ids: Optional[List[int]] = None,
        stop_regex: Optional[Union[str, List[str]]] = None, temperature: Optional[float] = None,
        top_p: Optional[float] = None, top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Optional[Any] = None,
        choices: Optional[List[str]] = None,
        choices_method: Optional[ChoicesSamplingMethod] = None, regex: Optional[str] = None,
        json_schema: Optional[Any] = None) -> SglExpr:
    """Generate into variable `name`. Options left None use the program's defaults.
    With `choices` this is `select`."""
    if choices:
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): invalid regex {regex!r}: {e}") from None
    params = SglSamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
        json_schema=json_schema_str(json_schema))
    return SglGen(name, params)


def gen_int(name: Optional[str] = None, **kwargs: Any) -> SglExpr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs: Any) -> SglExpr:
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[List[str]] = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    if not choices:
        raise ValueError("select needs choices=[...]")
    return SglSelect(name, choices, temperature, choices_method)


def image(path: str) -> SglExpr:
    raise NotImplementedError("sgl.image: this fork serves text-only models")


def video(path: str, num_frames: int) -> SglExpr:
    raise NotImplementedError("sgl.video: this fork serves text-only models")


def _role(role: str, expr: Any = None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])


def system(expr: Any = None) -> SglExprList:
    return _role("system", expr)


def user(expr: Any = None) -> SglExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    return _role("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")
