"""Running programs: one (`run_program`), many on a thread pool (`run_program_batch`),
and caching a program's constant prefix (`cache_program`)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Dict, Iterator, List, Union

from sglang.lang.global_config import global_config
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglFunction, SglSamplingParams
from sglang.lang.state import ProgramState


def resolve_backend(backend: Any) -> Any:
    """The backend to run on: the argument, else the default. A `Runtime` stands for its
    endpoint and an `sglang.Engine` for an EngineBackend around it."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call sgl.set_default_backend(...) first")
    if hasattr(backend, "endpoint"):
        return backend.endpoint
    if hasattr(backend, "tokenizer_manager") and hasattr(backend, "async_generate"):
        from sglang.lang.backend.engine_backend import EngineBackend

        return EngineBackend.for_engine(backend)
    return backend


def run_program(program: SglFunction, backend: Any, arguments: Dict[str, Any],
                default_sampling_params: SglSamplingParams, stream: bool = False) -> ProgramState:
    """Run `program` with keyword `arguments`. With `stream`, the Python function itself runs
    on a thread and this returns at once (read with `state.text_iter()`)."""
    backend = resolve_backend(backend)
    executor = StreamExecutor(backend, arguments, default_sampling_params, stream=stream)
    state = ProgramState(executor)

    def body() -> None:
        try:
            state.ret_value = program.func(state, **arguments)
        finally:
            executor.end()

    if stream:
        def guarded() -> None:
            try:
                body()
            except Exception as e:  # noqa: BLE001 - surfaces through state.error()
                executor.error_ = executor.error_ or e
                executor._finish()

        threading.Thread(target=guarded, name="sgl-program", daemon=True).start()
        return state
    body()
    executor.sync()
    return state


def _num_threads(num_threads: Union[str, int], n: int) -> int:
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive integer, got {num_threads!r}")
    return max(1, min(num_threads, n))


def run_program_batch(program: SglFunction, backend: Any, batch_arguments: List[Dict[str, Any]],
                      default_sampling_params: SglSamplingParams,
                      num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                      generator_style: bool = False):
    """States in input order (a list, or a generator with `generator_style`)."""
    backend = resolve_backend(backend)
    if generator_style:
        return _run_batch_iter(program, backend, batch_arguments, default_sampling_params,
                               num_threads, progress_bar)
    return list(_run_batch_iter(program, backend, batch_arguments, default_sampling_params,
                                num_threads, progress_bar))


def _run_batch_iter(program, backend, batch_arguments, defaults, num_threads,
                    progress_bar) -> Iterator[ProgramState]:
    if not batch_arguments:
        return
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        cache_program(program, backend)
    threads = _num_threads(num_threads, len(batch_arguments))
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(batch_arguments), desc=getattr(program, "__name__", "program"))

    def one(arguments: Dict[str, Any]) -> ProgramState:
        state = run_program(program, backend, arguments, defaults)
        if bar is not None:
            bar.update(1)
        return state

    try:
        if threads == 1:
            for arguments in batch_arguments:
                yield one(arguments)
            return
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="sgl-batch") as pool:
            futures = [pool.submit(one, arguments) for arguments in batch_arguments]
            try:
                for fut in futures:
                    yield fut.result()
            finally:
                for fut in futures:
                    fut.cancel()
    finally:
        if bar is not None:
            bar.close()


def cache_program(program: SglFunction, backend: Any = None) -> str:
    """Cache the program's constant prefix (found by tracing) on the backend when it is
    long enough to be worth a request; returns the prefix."""
    from sglang.lang.tracer import extract_prefix_by_tracing

    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if len(prefix) > global_config.precache_min_chars:
        backend.cache_prefix(prefix)
    return prefix
