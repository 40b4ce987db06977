"""Process lifecycle: a dead child takes the server down with a log line and a non-zero
exit; a start-up failure exits non-zero with the reason; the `sglang` CLI dispatches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

_PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_dead_child_exits_nonzero_with_reason(start_server, tiny_llama_dir):
    srv = start_server(tiny_llama_dir, ["--max-total-tokens", "4096", "--skip-server-warmup"])
    children = [p for p in psutil.Process(srv.proc.pid).children()
                if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(children) == 2, [p.cmdline() for p in children]
    victim = children[0]
    victim.send_signal(signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    log = srv.log()
    assert "process died (exit code -9)" in log and "Shutting the server down" in log
    time.sleep(0.5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)


def test_health_answers_while_the_scheduler_is_busy(start_server, tiny_llama_dir):
    """A worker stuck in a long prefill (here: its children stopped) is alive: /health says
    200 at once, where a probe that generates (/health_generate) waits behind the work; a
    router polling /health no longer drops a busy worker. Both answer 200 once it moves."""
    import requests

    srv = start_server(tiny_llama_dir, ["--max-total-tokens", "4096"])
    children = [p for p in psutil.Process(srv.proc.pid).children()
                if "resource_tracker" not in " ".join(p.cmdline())]
    for p in children:
        p.send_signal(signal.SIGSTOP)
    try:
        assert requests.get(srv.base_url + "/health", timeout=5).status_code == 200
        with pytest.raises(requests.exceptions.Timeout):
            requests.get(srv.base_url + "/health_generate", timeout=2)
    finally:
        for p in children:
            p.send_signal(signal.SIGCONT)
    assert requests.get(srv.base_url + "/health_generate", timeout=30).status_code == 200
    assert requests.get(srv.base_url + "/health", timeout=5).status_code == 200


def test_startup_failure_exits_nonzero(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                          str(tmp_path / "missing-model"), "--port", "1"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 1
    assert "could not start" in out.stderr and "scheduler failed to start" in out.stderr


@pytest.mark.parametrize("flags,message", [(["--dtype", "int3"], "--dtype must be one of"),
                                           (["--chat-template", "nope"], "--chat-template 'nope'")])
def test_bad_flag_exits_2(flags, message):
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "x", *flags],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 2 and message in out.stderr


def test_cli_version_and_serve_help():
    from sglang.version import __version__

    out = subprocess.run([sys.executable, "-c", "from sglang.cli import main; main()", "version"],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.stdout.strip() == __version__
    out = subprocess.run([sys.executable, "-c", "from sglang.cli import main; main()", "serve",
                          "--help"], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0 and "--model-path" in out.stdout and "--api-key" in out.stdout
