"""Real servers for the HTTP tests: `python -m sglang.launch_server` as a subprocess on a
free loopback port, polled on /health_generate until it answers, stopped at the end.

Each start costs ~10-20 s on a small machine, so the suite shares few servers: `server`
(session-wide, default flags) serves most tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import pytest
import requests

_PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A launched server; `log()` returns what it printed so far."""

    def __init__(self, model_dir: str, args: List[str], api_key: Optional[str] = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._log = tempfile.NamedTemporaryFile(prefix="sglang-server-", suffix=".log", delete=False)
        env = dict(os.environ)
        env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    @property
    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def _wait_ready(self) -> None:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.base_url + "/health_generate", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become ready in {START_TIMEOUT_S}s:\n{self.log()}")

    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("headers", self.headers)
        return requests.get(self.base_url + path, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, **kw) -> requests.Response:
        kw.setdefault("headers", self.headers)
        return requests.post(self.base_url + path, timeout=kw.pop("timeout", 60), **kw)

    def internal_state(self) -> dict:
        return self.get("/server_info").json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.time() + timeout
        while True:
            st = self.internal_state()
            if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
                return st
            if time.time() > deadline:
                raise AssertionError(f"server still busy: {st}")
            time.sleep(0.05)

    def assert_all_slots_free(self) -> None:
        """Invariant: idle + flushed => every KV slot is free again."""
        self.wait_idle()
        resp = self.post("/flush_cache")
        assert resp.status_code == 200, resp.text
        st = self.internal_state()
        assert st["available_kv_tokens"] == st["max_total_num_tokens"], st

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# The default server: small context so length limits are cheap to reach.
CONTEXT_LEN = 256


@pytest.fixture(scope="session")
def server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, ["--context-length", str(CONTEXT_LEN),
                                         "--max-total-tokens", "16384"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def start_server():
    """Factory for extra servers in a module: start_server(model_dir, args, api_key=None);
    all of them are stopped when the module ends."""
    started: List[ServerProcess] = []

    def start(model_dir: str, args: List[str], api_key: Optional[str] = None) -> ServerProcess:
        srv = ServerProcess(model_dir, args, api_key)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
