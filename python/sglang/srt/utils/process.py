"""Process helpers: logging set-up in children, and dying with the parent."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time


def configure_child_logging(level: str, name: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s")


def watch_parent(interval: float = 1.0) -> None:
    """Exit when the parent process is gone, so no orphan keeps a model in memory; and
    leave SIGINT / SIGTERM to the parent: a signal to the whole process group (Ctrl-C, the
    router's launch_server stopping its replicas) must not kill a child under a server that
    is still draining its requests. The parent stops its children (kill_process_tree)."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, daemon=True).start()


def kill_process_tree(procs) -> None:
    """Stop the children (SIGKILL: they ignore SIGTERM, see watch_parent)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
