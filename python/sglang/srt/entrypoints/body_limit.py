"""A request body larger than --max-request-body-bytes is refused with a 413 before any
route reads it: by its Content-Length when it gives one, else (chunked) as soon as the bytes
received pass the limit, so a client cannot make the server buffer without bound."""

from __future__ import annotations

from typing import Awaitable, Callable, List, Optional

Receive = Callable[[], Awaitable[dict]]


def too_large_message(limit: int) -> str:
    return (f"The request body is larger than this server takes ({limit} bytes): send a "
            "smaller request (e.g. fewer prompts per batch), or start the server with a larger "
            "--max-request-body-bytes.")


def declared_length(scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def bounded_receive(receive: Receive, limit: int) -> Optional[Receive]:
    """Reads the whole body (at most `limit` bytes) and returns a `receive` that replays it
    and then passes on (so disconnects still reach streaming routes); None when the body is
    over the limit."""
    messages: List[dict] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # the client went away: let the route see it
            break
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            break

    async def replay() -> dict:
        if messages:
            return messages.pop(0)
        return await receive()

    return replay
