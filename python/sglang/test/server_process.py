"""A real server in a subprocess: `python -m sglang.launch_server` on a free loopback port,
polled on /health_generate until it answers (the HTTP tests and scripts/gpu_check_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import requests

from sglang.srt.utils import free_port, wait_until_ready

# this checkout's python/ folder, for the child's imports (a source tree need not be installed)
_PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 180


class ServerProcess:
    """A launched server; `log()` returns what it printed so far."""

    def __init__(self, model_dir: str, args: List[str], api_key: Optional[str] = None,
                 port: Optional[int] = None, dtype: str = "float32",
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._log = tempfile.NamedTemporaryFile(prefix="sglang-server-", suffix=".log", delete=False)
        env = dict(os.environ)
        env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(start_timeout)

    @property
    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        state = wait_until_ready(self.proc, lambda: requests.get(
            self.base_url + "/health_generate", timeout=5).status_code == 200, timeout)
        if state == "ready":
            return
        if state == "exited":
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        self.stop()
        raise RuntimeError(f"server did not become ready in {timeout}s:\n{self.log()}")

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
