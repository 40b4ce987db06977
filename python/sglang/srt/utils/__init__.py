"""Small helpers with no engine state: ports, and waiting for a started server process.
`is_port_available` keeps upstream's import path (`sglang.srt.utils`): the sglang-router's
`launch_server` picks its workers' ports with it."""

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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(proc, ready, timeout: float, interval: float = 0.25) -> str:
    """Poll `ready()` (exceptions count as not yet) until it is true, the process `proc`
    (a Popen) exits, or `timeout` seconds pass: "ready", "exited" or "timeout"."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return "exited"
        try:
            if ready():
                return "ready"
        except Exception:
            pass
        time.sleep(interval)
    return "timeout"
