"""`EngineBackend`: run programs on an in-process `sglang.Engine`, no HTTP in between.

The engine's tokenizer manager lives on the engine's asyncio loop, which `Engine.generate`
drives with `run_until_complete` from one thread. Programs call from many threads (forks,
run_batch), so a `_LoopDriver` runs that loop on a background thread while any call is in
flight and stops it when the last one returns. Invariant: while a program runs on an
EngineBackend, nothing else may call the same engine's synchronous methods (they would
try to run the loop a second time); between programs they work as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Any, Awaitable, Dict, Iterator, Optional, Tuple

from sglang.lang.backend.srt_backend import SrtBackend
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path

_BODY_FIELDS = ("sampling_params", "input_ids", "return_logprob", "logprob_start_len",
                "top_logprobs_num", "return_text_in_logprobs", "stream")


class _LoopDriver:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._active = 0
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Keep the loop running on the driver thread for the duration."""
        with self._lock:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self.loop.run_forever,
                                                name="sgl-engine-loop", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.loop.call_soon_threadsafe(self.loop.stop)
                    self._thread.join()
                    self._thread = None

    def call(self, awaitable: Awaitable[Any]) -> Any:
        with self.running():
            return asyncio.run_coroutine_threadsafe(_await(awaitable), self.loop).result()


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def _next(agen: Any) -> Tuple[bool, Any]:
    try:
        return True, await agen.__anext__()
    except StopAsyncIteration:
        return False, None


_DRIVERS: "weakref.WeakKeyDictionary[Any, _LoopDriver]" = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


class EngineBackend(SrtBackend):
    """`EngineBackend(engine)` wraps a running Engine; `EngineBackend(model_path=..., **kw)`
    starts one (ServerArgs fields) and shuts it down with `shutdown()`."""

    def __init__(self, engine: Any = None, chat_template_name: Optional[str] = None,
                 **engine_kwargs: Any) -> None:
        self._owns_engine = engine is None
        if engine is None:
            from sglang.srt.entrypoints.engine import Engine

            engine = Engine(**engine_kwargs)
        elif engine_kwargs:
            raise TypeError("pass either an engine or Engine keyword arguments, not both")
        self.engine = engine
        with _DRIVERS_LOCK:
            if engine not in _DRIVERS:
                _DRIVERS[engine] = _LoopDriver(engine.loop)
            self._driver = _DRIVERS[engine]
        args = engine.server_args
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(args.model_path)

    @classmethod
    def for_engine(cls, engine: Any) -> "EngineBackend":
        return cls(engine)

    def _engine_kwargs(self, body: Dict[str, Any]) -> Dict[str, Any]:
        kwargs = {k: body[k] for k in _BODY_FIELDS if k in body}
        kwargs["prompt"] = body.get("text")
        return kwargs

    def _post(self, body: Dict[str, Any]) -> Any:
        return self._driver.call(self.engine.async_generate(**self._engine_kwargs(body)))

    def _post_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        with self._driver.running():
            agen = self._driver.call(self.engine.async_generate(**self._engine_kwargs(body)))
            try:
                while True:
                    ok, chunk = self._driver.call(_next(agen))
                    if not ok:
                        return
                    yield chunk
            finally:
                self._driver.call(agen.aclose())  # aborts the request when stopped early

    def get_model_name(self) -> str:
        return self.engine.server_args.model_path

    def flush_cache(self) -> bool:
        return self._driver.call(self.engine.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> Dict[str, Any]:
        state = self._driver.call(self.engine.tokenizer_manager.get_internal_state())
        return {**vars(self.engine.server_args), **state}

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()
