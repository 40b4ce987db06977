"""Small helpers with no engine state. `is_port_available` keeps upstream's import path
(`sglang.srt.utils`): the sglang-router's `launch_server` picks its workers' ports with it."""

from __future__ import annotations

import socket


def is_port_available(port: int) -> bool:
    """True when nothing listens on `port` (TCP, every interface) and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
            return True
        except OSError:
            return False
