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
    """Exit when the parent process is gone, so no orphan keeps a model in memory."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, daemon=True).start()


def kill_process_tree(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(timeout=1)
