"""What a program sees as `s`: `ProgramState`, and `ProgramStateGroup` for forks."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Union

from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglConcateAndAppend, SglExprList, SglRoleBegin, SglRoleEnd, as_expr


class ProgramState:
    """The state of one program run. Reading waits for the queued expressions it needs."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ------------------------------------------------------------------ building
    def __iadd__(self, other: Any) -> "ProgramState":
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is None:
            return self._role_scope(role)
        wrapped = SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])
        self.stream_executor.submit(wrapped)
        return wrapped

    @contextlib.contextmanager
    def _role_scope(self, role: str):
        self.stream_executor.submit(SglRoleBegin(role))
        yield
        self.stream_executor.submit(SglRoleEnd(role))

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> List[Dict[str, str]]:
        self.sync()
        return self.stream_executor.messages_

    def variables(self) -> Dict[str, Any]:
        self.sync()
        return dict(self.stream_executor.variables)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        self.sync()
        return self.stream_executor.error_

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Pieces of text as they are generated (needs `run(stream=True)`; otherwise the
        final text, or the variable's value, in one piece)."""
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        yield from self.stream_executor.iter_pieces(var_name)

    # ------------------------------------------------------------------ forks
    def fork(self, size: int = 1) -> "ProgramStateGroup":
        """`size` copies that continue from the text so far, each on its own thread."""
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    def copy(self) -> "ProgramState":
        return self.fork(1)[0]

    def __enter__(self) -> "ProgramState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream_executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: List[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Union[Any, List[Any]]) -> "ProgramStateGroup":
        """`forks += expr` adds expr to every fork; a list adds one item per fork."""
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the forks created becomes a list (one value per
        fork) in the source state. concate_and_append: the text each fork added is
        appended to the source state, in fork order."""
        src = self.src_state.stream_executor
        if mode == "gather_variable":
            src.sync()
            before = set(src.variables)
            gathered: Dict[str, List[Any]] = {}
            for state in self.states:
                state.sync()
                for name, value in state.stream_executor.variables.items():
                    if name not in before:
                        gathered.setdefault(name, []).append(value)
            for name, values in gathered.items():
                src.set_var(name, values)
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend([s.stream_executor for s in self.states])
            src.sync()
        else:
            raise ValueError(f"unknown join mode {mode!r}; use gather_variable or concate_and_append")
        for state in self.states:
            state.stream_executor.end()
