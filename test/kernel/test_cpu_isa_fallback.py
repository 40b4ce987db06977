"""The AVX2-only kernels, built and tested on a CPU that would otherwise take its AVX-512
paths: a machine without AVX-512 (as a CI or user machine may be) runs this code, so it is
tested wherever the suite runs. Builds a second copy of the extension (~2 min, cached)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_kernel import cpu

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def test_avx2_kernels_pass_the_kernel_tests() -> None:
    if not cpu.is_available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    if cpu.linear_isa() == "avx2" and os.environ.get("SGL_KERNEL_MARCH") is None:
        pytest.skip("the native build is the AVX2 code already: the other kernel tests ran it")
    env = dict(os.environ, SGL_KERNEL_MARCH="haswell",
               PYTHONPATH=os.pathsep.join([os.path.join(_ROOT, "sgl-kernel"),
                                           os.path.join(_ROOT, "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    files = [os.path.join(_HERE, f) for f in ("test_cpu_linear.py", "test_cpu_decode_attention.py",
                                               "test_cpu_elementwise.py")]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--timeout", "600", *files],
                         capture_output=True, text=True, timeout=900, env=env, cwd=_ROOT)
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    probe = subprocess.run([sys.executable, "-c", "from sgl_kernel import cpu; print(cpu.linear_isa())"],
                           capture_output=True, text=True, timeout=900, env=env, cwd=_ROOT)
    assert probe.stdout.strip() == "avx2", probe.stdout + probe.stderr


def test_vdpbf16ps_attention_without_amx_passes_the_attention_tests() -> None:
    """On a CPU with AMX, bf16 attention takes the tile path; CPUs with AVX512-BF16 but no AMX
    (and processes Linux refuses AMX state) take the VDPBF16PS one: SGL_KERNEL_NO_AMX=1 runs
    the attention tests through it here, with the same build."""
    if not cpu.is_available() or cpu.attention_isa() != "amx-bf16":
        pytest.skip("no AMX attention on this CPU: the other tests ran the path it has")
    env = dict(os.environ, SGL_KERNEL_NO_AMX="1",
               PYTHONPATH=os.pathsep.join([os.path.join(_ROOT, "sgl-kernel"),
                                           os.path.join(_ROOT, "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--timeout", "600", os.path.join(_HERE, "test_cpu_decode_attention.py")],
                         capture_output=True, text=True, timeout=900, env=env, cwd=_ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    probe = subprocess.run([sys.executable, "-c", "from sgl_kernel import cpu; print(cpu.attention_isa())"],
                           capture_output=True, text=True, timeout=900, env=env, cwd=_ROOT)
    assert probe.stdout.strip() == "avx512bf16", probe.stdout + probe.stderr


def test_a_kernel_build_says_when_it_starts_where_it_caches_and_how_it_ended() -> None:
    """A first start compiles for 1-2 minutes with nothing on screen otherwise: the build
    logs a line before it begins (with the cache folder) and one when it ends. A -march the
    compiler refuses ends it in seconds, with the line saying torch's ops are used."""
    if not cpu.is_available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    env = dict(os.environ, SGL_KERNEL_MARCH="no-such-cpu",
               PYTHONPATH=os.pathsep.join([os.path.join(_ROOT, "sgl-kernel"),
                                           os.environ.get("PYTHONPATH", "")]))
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from sgl_kernel import cpu\n"
            "print('available', cpu.is_available(), cpu.build_dir())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=env, cwd=_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("available False")
    cache = out.stdout.split()[-1]
    assert f"Building the CPU kernels (first use on this machine, 1-2 min); cached in {cache}" \
        in out.stderr
    assert "CPU kernels unavailable, torch's ops are used instead" in out.stderr
