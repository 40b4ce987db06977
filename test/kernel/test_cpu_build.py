"""The CPU kernels' build cache survives a builder killed mid-build: torch's own build lock
would make every later process wait on it forever (how a CI run can hang in silence)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_kernel import cpu

_KERNEL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(cpu.__file__)))


def test_left_over_build_lock_does_not_block_loading() -> None:
    if not cpu.is_available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    lock = os.path.join(cpu.build_dir(), "lock")
    with open(lock, "w"):
        pass  # what a build killed between taking torch's lock and releasing it leaves
    code = "from sgl_kernel import cpu; print(cpu.is_available())"
    env = dict(os.environ, PYTHONPATH=_KERNEL_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the kernels waited on a dead builder's lock")
    finally:
        if os.path.exists(lock):
            os.remove(lock)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout + out.stderr
    assert not os.path.exists(lock)
