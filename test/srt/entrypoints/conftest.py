"""Real servers for the HTTP tests: `python -m sglang.launch_server` as a subprocess on a
free loopback port, polled on /health_generate until it answers, stopped at the end.

Each start costs ~10-20 s on a small machine, so the suite shares few servers: `server`
(session-wide, default flags) serves most tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional

import pytest
import requests

from sglang.srt.utils import free_port, wait_until_ready
from sglang.test.server_process import _PYTHON_DIR, ServerProcess  # noqa: F401 (fixtures)


# The default server: small context and body limit, so length limits are cheap to reach.
CONTEXT_LEN = 256


@pytest.fixture(scope="session")
def server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, ["--context-length", str(CONTEXT_LEN),
                                         "--max-total-tokens", "16384",
                                         "--max-request-body-bytes", "1M"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def start_server():
    """Factory for extra servers in a module: start_server(model_dir, args, api_key=None);
    all of them are stopped when the module ends."""
    started: List[ServerProcess] = []

    def start(model_dir: str, args: List[str], api_key: Optional[str] = None,
              port: Optional[int] = None) -> ServerProcess:
        srv = ServerProcess(model_dir, args, api_key, port)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def generate(url: str, text: str, max_tokens: int = 4, timeout: float = 60) -> requests.Response:
    """Greedy native /generate of exactly `max_tokens` tokens (ignore_eos)."""
    return requests.post(url + "/generate", timeout=timeout, json={
        "text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True}})


class RouterProcess:
    """The real sglang-router (PyPI): `python -m sglang_router.<module> ...` on a free port in
    its own process group, ready when a generation through it answers (the router is up
    before its workers are)."""

    def __init__(self, module: str, args: List[str], start_timeout: float = 240) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log",
                                                delete=False)
        env = dict(os.environ)
        env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
        # each router exports Prometheus metrics on a port of its own (a shared default
        # port makes the second router in a run panic)
        self.metrics_port = free_port()
        prom = "--prometheus-port" if module == "launch_router" else "--router-prometheus-port"
        cmd = [sys.executable, "-m", f"sglang_router.{module}", "--host", "127.0.0.1",
               "--port", str(self.port), prom, str(self.metrics_port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        state = wait_until_ready(self.proc, self._serves, start_timeout, interval=0.5)
        if state != "ready":
            self.stop()
            raise RuntimeError(f"router {state} ({self.proc.returncode}):\n{self.log()}")

    def _serves(self) -> bool:
        """A generation through the router answers; a panic in its log (it keeps running
        after one) fails at once."""
        if "PanicException" in self.log():
            self.proc.kill()
            return False
        return generate(self.url, "Hello", max_tokens=1, timeout=10).status_code == 200

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def generate(self, text: str, max_tokens: int = 4, timeout: float = 60) -> requests.Response:
        return generate(self.url, text, max_tokens, timeout)

    def metrics(self) -> str:
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def stop(self) -> None:
        """SIGTERM to the whole group (launch_server's replicas too), SIGKILL if it hangs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def start_router():
    """Factory: start_router(module, args) -> RouterProcess; all stopped when the module ends."""
    started: List[RouterProcess] = []

    def start(module: str, args: List[str]) -> RouterProcess:
        router = RouterProcess(module, args)
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()
