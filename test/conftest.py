"""Shared pytest setup: make `sglang` importable from the checkout; tiny model fixtures."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
if importlib.util.find_spec("sglang") is None:
    sys.path.insert(0, _PYTHON_DIR)
_KERNEL_DIR = os.path.join(os.path.dirname(_PYTHON_DIR), "sgl-kernel")
if importlib.util.find_spec("sgl_kernel") is None:
    sys.path.insert(0, _KERNEL_DIR)


def pytest_configure(config: pytest.Config) -> None:
    # The kernel build (in the header below) and collection run before any test's timeout
    # applies: if either hangs, print every thread's stack and end the run.
    import faulthandler

    faulthandler.dump_traceback_later(1200, exit=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    import faulthandler

    faulthandler.cancel_dump_traceback_later()


def pytest_report_header(config: pytest.Config) -> list:
    """What a slow or stuck CI run needs to be read: the CPUs this process may use (an
    affinity or cgroup quota smaller than the machine makes OpenMP oversubscribe), torch's
    thread count, and whether the CPU kernels are built (building them here, once, before
    any server process could race for the build)."""
    import torch

    lines = [f"cpus: os {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}, "
             f"torch threads {torch.get_num_threads()}"]
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            lines[0] += f", cgroup cpu.max {f.read().strip()}"
    except OSError:
        pass
    try:
        import time

        from sgl_kernel import cpu

        t0 = time.time()
        ok = cpu.is_available()
        state = f"built ({time.time() - t0:.0f} s)" if ok else cpu.unavailable_reason()
        lines.append(f"sgl_kernel cpu: {state}, {cpu.build_dir()}")
    except Exception as e:  # a header must never stop the run
        lines.append(f"sgl_kernel cpu: {type(e).__name__}: {e}")
    return lines


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from sglang.test.fixtures import build_tiny_model

    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from sglang.test.fixtures import build_tiny_model

    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("tiny") / "qwen2"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from sglang.test.fixtures import build_tiny_model

    return build_tiny_model("mistral", str(tmp_path_factory.mktemp("tiny") / "mistral"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from sglang.test.fixtures import smollm2_gguf_path

    return smollm2_gguf_path()
