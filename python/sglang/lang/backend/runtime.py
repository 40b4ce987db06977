"""`sgl.Runtime`: start `python -m sglang.launch_server` as a child process and talk to it.

`Runtime(model_path=..., **server_args)` picks a free loopback port unless `port=` is
given, waits until /health_generate answers, and exposes `.url` and `.endpoint` (a
RuntimeEndpoint; programs accept the Runtime itself as a backend). `shutdown()` (also at
exit) stops the server: SIGTERM, then SIGKILL after 30 s.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import requests

import sglang
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.srt.utils import free_port, wait_until_ready


def _flags(kwargs: Dict[str, Any]) -> List[str]:
    argv: List[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


class Runtime:
    def __init__(self, log_level: str = "error", launch_timeout: float = 300.0,
                 host: str = "127.0.0.1", port: Optional[int] = None,
                 log_file: Optional[str] = None, **server_args: Any) -> None:
        if "model_path" not in server_args:
            raise TypeError("Runtime needs model_path=")
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.generate_url = self.url + "/generate"
        argv = [sys.executable, "-m", "sglang.launch_server", "--host", host,
                "--port", str(self.port), "--log-level", log_level, *_flags(server_args)]
        # The child imports the same sglang as this process, installed or not.
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._log = open(log_file, "ab") if log_file else None
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT if self._log else None)
        atexit.register(self.shutdown)
        self._wait_ready(launch_timeout)
        self.endpoint = RuntimeEndpoint(self.url, api_key=server_args.get("api_key"))

    def _wait_ready(self, timeout: float) -> None:
        state = wait_until_ready(self.proc, lambda: requests.get(
            self.url + "/health_generate", timeout=5).status_code == 200, timeout)
        if state == "ready":
            return
        if state == "exited":
            code = self.proc.returncode
            self.shutdown()
            raise RuntimeError(f"the server exited with code {code} while starting")
        self.shutdown()
        raise TimeoutError(f"the server did not become ready within {timeout:.0f} s")

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_server_info(self) -> Dict[str, Any]:
        return self.endpoint.get_server_info()

    def generate(self, prompt: Any, sampling_params: Optional[Dict[str, Any]] = None,
                 **fields: Any) -> Any:
        """POST /generate with `text=prompt`; the decoded response."""
        return self.endpoint._post({"text": prompt, "sampling_params": sampling_params or {},
                                    **fields})

    def shutdown(self) -> None:
        proc, self.proc = getattr(self, "proc", None), None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.shutdown()
        except Exception:
            pass

