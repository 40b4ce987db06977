"""Tracing: run a program without a model to find the text every run starts with.

Arguments that are not bound become placeholder strings, so a program may format them
freely (f-strings, `+`, `.strip()`): the constant prefix is the traced text up to the
first placeholder, the first `gen` / `select`, a variable read or a fork. Used to warm
the prefix cache (`run_batch`, `SglFunction.cache`, the review job). A wrong guess only
costs a request; it never changes results.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Optional

from sglang.lang.chat_template import ChatTemplate, get_chat_template
from sglang.lang.interpreter import StopTracing, StreamExecutor
from sglang.lang.ir import SglFunction, SglSamplingParams
from sglang.lang.state import ProgramState

logger = logging.getLogger(__name__)

# Survives upper()/lower()/strip() and never occurs in real prompts.
_MARK = "\x00"


def placeholder(name: str) -> str:
    return f"{_MARK}{name}{_MARK}"


@dataclasses.dataclass
class TracedProgram:
    prefix: str  # constant text every run starts with
    text: str  # everything traced, placeholders included
    complete: bool  # the program ran to its end without needing the model


def trace_program(program: SglFunction, arguments: Optional[Dict[str, Any]] = None,
                  backend: Any = None, chat_template: Optional[ChatTemplate] = None
                  ) -> TracedProgram:
    """Trace with `arguments` (plus bound ones and defaults); the rest are placeholders."""
    if chat_template is None:
        chat_template = _template_of(backend)
    given = {**program.bind_arguments, **(arguments or {})}
    args = {}
    for name in program.arg_names:
        if name in given:
            args[name] = given[name]
        elif name in program.arg_defaults:
            args[name] = program.arg_defaults[name]
        else:
            args[name] = placeholder(name)
    executor = StreamExecutor(backend, args, SglSamplingParams(), chat_template,
                              use_thread=False, tracing=True)
    complete = False
    try:
        program.func(ProgramState(executor), **args)
        complete = True
    except StopTracing:
        pass
    except Exception as e:  # noqa: BLE001 - a program may not cope with placeholders
        logger.debug("tracing %s stopped: %r", program.__name__, e)
    text = executor.text_
    cut = text.find(_MARK)
    return TracedProgram(text if cut < 0 else text[:cut], text, complete and cut < 0)


def extract_prefix_by_tracing(program: SglFunction, backend: Any = None) -> str:
    return trace_program(program, None, backend).prefix


def _template_of(backend: Any) -> ChatTemplate:
    from sglang.lang.run import resolve_backend

    try:
        return resolve_backend(backend).get_chat_template()
    except ValueError:  # no backend at all: trace with the default template
        return get_chat_template("default")
