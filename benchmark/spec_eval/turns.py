"""Configurations take turns round by round (no sglang imports: vLLM's environment loads it).

This VM's speed drifts 20-50% over minutes, so configurations run one after another compare
different machines. Instead every configuration of a group is loaded in its own process and
they decode in turns: round 1 of each, then round 2 of each, ... Each process keeps its
prefix cache between its rounds, as before. Protocol over the worker's stdin / stdout:
the worker prints `@@ready` once loaded, waits for `go R` before round R and prints
`@@done R` after it; any other stdout line is progress, echoed by the parent.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Dict, List

ENV = "SPEC_EVAL_TURNS"  # set in a worker's environment: it waits for its turns


def turns_on() -> bool:
    return os.environ.get(ENV) == "1"


def ready() -> None:
    if turns_on():
        print("@@ready", flush=True)


def wait_turn(r: int) -> None:
    """Blocks until the parent says it is round r's turn (returns at once without turns)."""
    if not turns_on():
        return
    line = sys.stdin.readline().split()
    if line != ["go", str(r)]:
        raise RuntimeError(f"expected 'go {r}' from the parent, got {line!r}")


def done_turn(r: int) -> None:
    if turns_on():
        print(f"@@done {r}", flush=True)


class Turn:
    """One worker process on the parent's side; a thread drains its stdout so a worker that
    logs while another has the turn never blocks on a full pipe."""

    def __init__(self, name: str, cmd: List[str], env: Dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(cmd, env={**env, ENV: "1"}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)  # kill() reaches its children
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("@@eof")

    def wait_for(self, marker: str) -> None:
        while True:
            line = self.lines.get()
            if line == marker:
                return
            if line == "@@eof":
                rc = self.proc.wait()
                raise RuntimeError(f"{self.name}: worker exited (rc {rc}) before '{marker}'")
            if not line.startswith("@@"):
                print(line, flush=True)

    def go(self, r: int) -> None:
        self.proc.stdin.write(f"go {r}\n")
        self.proc.stdin.flush()
        self.wait_for(f"@@done {r}")

    def finish(self) -> None:
        self.proc.stdin.close()
        self.wait_for("@@eof")
        if self.proc.wait() != 0:
            raise RuntimeError(f"{self.name}: worker failed (rc {self.proc.returncode})")

    def kill(self) -> None:
        """The worker and every process it started (vLLM's engine core and CPU worker
        outlive a killed worker otherwise, holding their memory)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
