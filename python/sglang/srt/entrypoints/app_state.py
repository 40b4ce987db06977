"""What the HTTP routes share: the server's state (set once at launch) and the native API's
error body, `{"error": {"message": ...}}`."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, Optional

from fastapi import Request
from fastapi.responses import Response

from sglang.srt.entrypoints.json_body import loads_body
from sglang.srt.entrypoints.openai.serving_base import SafeJSONResponse, error_object
from sglang.srt.server_args import ServerArgs


class AppState:
    tokenizer_manager: Any = None
    server_args: Optional[ServerArgs] = None
    scheduler_info: Dict[str, Any] = {}
    ready: bool = False  # warm-up done
    draining: bool = False  # SIGTERM received: no new requests
    shutting_down: bool = False  # children are being stopped on purpose
    loop: Optional[asyncio.AbstractEventLoop] = None
    chat: Any = None
    completions: Any = None


state = AppState()


def serving() -> bool:
    """Warmed, not draining, and every child process alive."""
    tm = state.tokenizer_manager
    return state.ready and not state.draining and tm is not None and not tm.dead_message


def native_error(message: str, status: int = 400) -> Response:
    return SafeJSONResponse({"error": {"message": message}}, status_code=status)


def refused(path: str, message: str, status: int) -> Response:
    """An error in the shape of the API the path belongs to (OpenAI's under /v1/)."""
    if path.startswith("/v1/"):
        return SafeJSONResponse(error_object(message, status), status_code=status)
    return native_error(message, status)


async def read_json(request: Request) -> Any:
    return loads_body(await request.body())
