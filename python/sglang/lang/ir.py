"""The program's expressions (text, gen, select, roles) and `SglFunction`.

`s += expr` hands an expression to the program's executor; `"text" + gen(...)` builds an
`SglExprList`. Sampling options left as None in a gen take the program's defaults (the
arguments of `run` / `run_batch`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Callable, Dict, List, Optional, Union

from sglang.lang.choices import ChoicesSamplingMethod

# The regexes upstream's frontend sends for typed gens (`gen_int`, `dtype=...`).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_OPTIONAL_TOP_LEVEL = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                       "return_text_in_logprobs")


@dataclasses.dataclass
class SglSamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: Optional[int] = 0
    n: Optional[int] = 1
    stop: Optional[Union[str, List[str], tuple]] = ()
    stop_token_ids: Optional[Union[List[int], tuple]] = ()
    stop_regex: Optional[Union[str, List[str], tuple]] = ()
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = -1
    min_p: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    ignore_eos: Optional[bool] = False
    # Sent at the top level of the request body, only when set.
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    # Constrained generation; `dtype` turns into a regex (and stops) before sending.
    dtype: Optional[Any] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def clone(self) -> "SglSamplingParams":
        def copy(v: Any) -> Any:
            return list(v) if isinstance(v, list) else v

        return SglSamplingParams(**{f.name: copy(getattr(self, f.name))
                                    for f in dataclasses.fields(self)})

    def overridden_by(self, other: "SglSamplingParams") -> "SglSamplingParams":
        """A copy of self with every field that `other` sets (not None)."""
        out = self.clone()
        for f in dataclasses.fields(other):
            value = getattr(other, f.name)
            if value is not None:
                setattr(out, f.name, list(value) if isinstance(value, list) else value)
        return out

    def to_srt_kwargs(self) -> Dict[str, Any]:
        """The `sampling_params` of a /generate body, in upstream's key order."""
        def listify(v: Any) -> Any:
            return list(v) if isinstance(v, (list, tuple)) else v

        return {
            "max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens,
            "n": self.n, "stop": listify(self.stop),
            "stop_token_ids": listify(self.stop_token_ids),
            "stop_regex": listify(self.stop_regex), "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty, "ignore_eos": self.ignore_eos,
            "regex": self.regex, "json_schema": self.json_schema,
        }

    def top_level_kwargs(self) -> Dict[str, Any]:
        """Logprob options that go beside `sampling_params` in the body."""
        return {k: getattr(self, k) for k in _OPTIONAL_TOP_LEVEL if getattr(self, k) is not None}


# ---------------------------------------------------------------------- expressions
class SglExpr:
    def __add__(self, other: Any) -> "SglExprList":
        return SglExprList.concat(self, other)

    def __radd__(self, other: Any) -> "SglExprList":
        return SglExprList.concat(other, self)


def as_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot add {type(x).__name__} to a program; use a str or an sgl expression")


class SglExprList(SglExpr):
    def __init__(self, expr_list: List[SglExpr]) -> None:
        self.expr_list = expr_list

    @staticmethod
    def concat(a: Any, b: Any) -> "SglExprList":
        parts: List[SglExpr] = []
        for x in (as_expr(a), as_expr(b)):
            parts.extend(x.expr_list if isinstance(x, SglExprList) else [x])
        return SglExprList(parts)

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    def __init__(self, name: Optional[str], sampling_params: SglSamplingParams) -> None:
        self.name = name
        self.sampling_params = sampling_params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: List[str], temperature: float,
                 choices_method: ChoicesSamplingMethod) -> None:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("select needs a non-empty list of strings as choices")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglConcateAndAppend(SglExpr):
    """Append what each fork added after the fork point (join mode "concate_and_append")."""

    def __init__(self, states: List[Any]) -> None:
        self.states = states


def json_schema_str(schema: Any) -> Optional[str]:
    """Native /generate takes json_schema as a JSON *string*; accept dicts for convenience."""
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema)


# ---------------------------------------------------------------------- functions
class SglFunction:
    """A program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[Dict[str, Any]] = None) -> None:
        self.func = func
        # Only meaningful for API-model backends upstream; accepted and kept.
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise ValueError(f"the first parameter of {func.__name__} must be 's'")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = {p.name: p.default for p in params[1:]
                             if p.default is not inspect.Parameter.empty}
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__} has no parameter(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def arguments(self, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Keyword arguments for one call: bound values, then positionals, then kwargs."""
        free = [n for n in self.arg_names if n not in self.bind_arguments]
        if len(args) > len(free):
            raise TypeError(f"{self.__name__} takes {len(free)} argument(s), got {len(args)}")
        out = {**self.bind_arguments, **dict(zip(free, args)), **kwargs}
        missing = [n for n in self.arg_names if n not in out and n not in self.arg_defaults]
        if missing:
            raise TypeError(f"{self.__name__} is missing argument(s) {missing}")
        return out

    def run(self, *args: Any, max_new_tokens: int = 128, min_new_tokens: int = 0, n: int = 1,
            stop: Optional[Union[str, List[str]]] = None,
            stop_token_ids: Optional[List[int]] = None,
            stop_regex: Optional[Union[str, List[str]]] = None, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: Optional[bool] = None,
            logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
            return_text_in_logprobs: Optional[bool] = None, stream: bool = False,
            backend: Any = None, **kwargs: Any):
        from sglang.lang.run import run_program

        defaults = _defaults(locals())
        return run_program(self, backend, self.arguments(args, kwargs), defaults, stream)

    def run_batch(self, batch_kwargs: List[Any], *, max_new_tokens: int = 128,
                  min_new_tokens: int = 0, n: int = 1,
                  stop: Optional[Union[str, List[str]]] = None,
                  stop_token_ids: Optional[List[int]] = None,
                  stop_regex: Optional[Union[str, List[str]]] = None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
                  top_logprobs_num: Optional[int] = None,
                  return_text_in_logprobs: Optional[bool] = None, backend: Any = None,
                  num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False):
        """Run once per entry of `batch_kwargs` (dicts of arguments, or tuples of
        positional ones) on `num_threads` threads; states come back in input order."""
        from sglang.lang.run import run_program_batch

        defaults = _defaults(locals())
        calls = [self.arguments((), kw) if isinstance(kw, dict) else self.arguments(tuple(kw), {})
                 for kw in batch_kwargs]
        return run_program_batch(self, backend, calls, defaults, num_threads, progress_bar,
                                 generator_style)

    def trace(self, *, backend: Any = None, **kwargs: Any):
        from sglang.lang.tracer import trace_program

        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> str:
        """Send the program's constant prefix to the backend's prefix cache; returns it."""
        from sglang.lang.run import cache_program

        return cache_program(self, backend)

    def __call__(self, *args: Any, **kwargs: Any):
        return self.run(*args, **kwargs)


def _defaults(call_locals: Dict[str, Any]) -> SglSamplingParams:
    names = {f.name for f in dataclasses.fields(SglSamplingParams)}
    values = {k: v for k, v in call_locals.items() if k in names}
    # Unset list options are sent as [] (upstream's body), so default them here.
    for key in ("stop", "stop_token_ids", "stop_regex"):
        if values.get(key) is None:
            values[key] = []
    return SglSamplingParams(**values)
