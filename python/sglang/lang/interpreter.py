"""Executing programs: one `StreamExecutor` per program state, on its own thread.

`s += expr` only queues the expression, so Python code runs ahead of the model; reading a
variable (`s["x"]`), `text()`, `fork()` or the end of the program waits for the queue.
Invariants: expressions of one state run in submission order; after an error the state
runs nothing more, every waiter is released and `error()` returns it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from sglang.lang.chat_template import ChatTemplate
from sglang.lang.ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglConcateAndAppend,
                            SglConstantText, SglExpr, SglExprList, SglGen, SglRoleBegin,
                            SglRoleEnd, SglSamplingParams, SglSelect, as_expr)

logger = logging.getLogger(__name__)

# dtype -> (regex, extra stop strings), as upstream's frontend sends them.
_DTYPES = {int: (REGEX_INT, [" ", "\n"]), "int": (REGEX_INT, [" ", "\n"]),
           float: (REGEX_FLOAT, [" ", "\n"]), "float": (REGEX_FLOAT, [" ", "\n"]),
           str: (REGEX_STR, []), "str": (REGEX_STR, []),
           bool: (REGEX_BOOL, []), "bool": (REGEX_BOOL, [])}


class StopTracing(Exception):
    """Raised inside a traced program where the text stops being constant."""


_END = object()


class StreamExecutor:
    def __init__(self, backend: Any, arguments: Dict[str, Any],
                 default_sampling_params: SglSamplingParams,
                 chat_template: Optional[ChatTemplate] = None, stream: bool = False,
                 use_thread: bool = True, tracing: bool = False) -> None:
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_params = default_sampling_params
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.tracing = tracing
        self.text_ = ""
        self.messages_: List[Dict[str, str]] = []
        self.variables: Dict[str, Any] = {}
        self.meta_info: Dict[str, Any] = {}
        self.variable_event: Dict[str, threading.Event] = {}
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos = 0
        self.fork_start_text_pos = 0
        self.error_: Optional[BaseException] = None
        self.children: List["StreamExecutor"] = []
        # (variable name or None, text) pieces for text_iter, kept only when streaming
        self._pieces: List[Tuple[Optional[str], str]] = []
        self._cond = threading.Condition()
        self._finished = False
        self._ended = False
        self.use_thread = use_thread
        if use_thread:
            self.queue: "queue.Queue[Any]" = queue.Queue()
            self.worker = threading.Thread(target=self._work, name="sgl-executor", daemon=True)
            self.worker.start()

    # ------------------------------------------------------------------ queue
    def submit(self, expr: Any) -> None:
        if self._ended:
            raise RuntimeError("this program state has ended; it takes no more expressions")
        expr = as_expr(expr)
        self._register_events(expr)
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        """No more expressions: the worker finishes what is queued, then exits."""
        if not self._ended:
            self._ended = True
            if self.use_thread:
                self.queue.put(_END)
            else:
                self._finish()
        for child in self.children:
            child.end()

    def _work(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is _END:
                    self._finish()
                    return
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except Exception as e:  # noqa: BLE001 - stored for error()
                        logger.error("error in an sglang program: %r", e, exc_info=True)
                        self.error_ = e
                        for event in list(self.variable_event.values()):
                            event.set()
                        self._finish()
                else:  # skipped after an error: release whoever waits on its variables
                    self._register_events(expr, release=True)
            finally:
                self.queue.task_done()

    def _finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _register_events(self, expr: SglExpr, release: bool = False) -> None:
        if isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._register_events(e, release)
        elif isinstance(expr, (SglGen, SglSelect)) and expr.name is not None:
            event = self.variable_event.get(expr.name)
            if release:
                if event is not None:
                    event.set()
            elif event is None or event.is_set():  # re-generated: wait for the new value
                self.variable_event[expr.name] = threading.Event()

    # ------------------------------------------------------------------ variables
    def get_var(self, name: str) -> Any:
        if self.tracing:
            raise StopTracing(name)
        event = self.variable_event.get(name)
        if event is None:
            self.sync()
        else:
            event.wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise RuntimeError(f"variable {name!r} was not produced: {self.error_!r}") from self.error_
            raise KeyError(name)
        return self.variables[name]

    def set_var(self, name: str, value: Any, meta_info: Any = None) -> None:
        self.variables[name] = value
        if meta_info is not None:
            self.meta_info[name] = meta_info
        with self._cond:
            self.variable_event.setdefault(name, threading.Event()).set()
            self._cond.notify_all()

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    # ------------------------------------------------------------------ execution
    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglConcateAndAppend):
            for child in expr.states:
                child.sync()
                self._fill(child.text_[child.fork_start_text_pos:])
        else:
            raise TypeError(f"unsupported expression {expr!r}")

    def _fill(self, text: str, var: Optional[str] = None) -> None:
        self.text_ += text
        if self.stream:
            with self._cond:
                self._pieces.append((var, text))
                self._cond.notify_all()

    def resolve_sampling_params(self, params: SglSamplingParams) -> SglSamplingParams:
        """Program defaults overridden by the gen's own options, then the template's stop
        strings, then the typed-gen regex and stops (the order upstream applies them)."""
        out = self.default_sampling_params.overridden_by(params)

        def stop_list() -> List[str]:
            stop = out.stop
            return [stop] if isinstance(stop, str) else list(stop or [])

        if self.chat_template.stop_str:
            out.stop = stop_list() + list(self.chat_template.stop_str)
        if out.dtype is not None:
            if out.dtype not in _DTYPES:
                raise ValueError(f"unsupported dtype {out.dtype!r}; use int, float, str or bool")
            regex, extra_stop = _DTYPES[out.dtype]
            if extra_stop:
                out.stop = stop_list() + extra_stop
            out.regex = regex
        return out

    def _execute_gen(self, expr: SglGen) -> None:
        if self.tracing:
            raise StopTracing(expr.name)
        params = self.resolve_sampling_params(expr.sampling_params)
        name = expr.name
        if self.stream and (params.n or 1) == 1:
            comp, meta = "", None
            for piece, meta in self.backend.generate_stream(self, params):
                comp += piece
                if name is not None:
                    self.variables[name] = comp
                self._fill(piece, name)
        else:
            comp, meta = self.backend.generate(self, params)
            if isinstance(comp, str):  # n > 1 gives a list of samples and adds no text
                self._fill(comp, name)
        if name is not None:
            self.set_var(name, comp, meta)

    def _execute_select(self, expr: SglSelect) -> None:
        if self.tracing:
            raise StopTracing(expr.name)
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision, expr.name)
        if expr.name is not None:
            self.set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    # ------------------------------------------------------------------ fork / stream
    def fork(self, size: int) -> List["StreamExecutor"]:
        if self.tracing:
            raise StopTracing("fork")
        self.sync()
        if self.error_ is not None:
            raise RuntimeError(f"cannot fork a failed program: {self.error_!r}") from self.error_
        if size > 1 and self.text_:
            self.backend.cache_prefix(self.text_)  # the forks then share the prefix's KV
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.arguments, self.default_sampling_params,
                                   self.chat_template, self.stream)
            child.text_ = self.text_
            child.messages_ = [dict(m) for m in self.messages_]
            child.meta_info = dict(self.meta_info)
            for name, value in self.variables.items():
                child.set_var(name, value)
            child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            forks.append(child)
        self.children.extend(forks)
        return forks

    def iter_pieces(self, var: Optional[str] = None) -> Iterator[str]:
        """Text as it is produced: everything, or only variable `var`'s pieces."""
        pos = 0
        while True:
            with self._cond:
                while pos >= len(self._pieces) and not self._finished and not (
                        var is not None and self._var_done(var)):
                    self._cond.wait()
                batch = self._pieces[pos:]
                pos = len(self._pieces)
                done = self._finished or (var is not None and self._var_done(var))
            for name, text in batch:
                if var is None or name == var:
                    yield text
            if done:
                return

    def _var_done(self, var: str) -> bool:
        event = self.variable_event.get(var)
        return event is not None and event.is_set()


_MOVED = {"ProgramState": "sglang.lang.state", "ProgramStateGroup": "sglang.lang.state",
          "run_program": "sglang.lang.run", "run_program_batch": "sglang.lang.run",
          "cache_program": "sglang.lang.run"}


def __getattr__(name: str) -> Any:
    # Upstream keeps these in this module; they live beside it here (no import cycle).
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
