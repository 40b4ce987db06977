"""`import sglang` must not import torch (the frontend and clients run without it)."""

import subprocess
import sys


def test_import_sglang_does_not_import_torch():
    code = "import sys, sglang; sglang.__version__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
