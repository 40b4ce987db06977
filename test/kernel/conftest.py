"""Shared setup of the CPU kernel tests: `sgl_kernel` importable from the checkout, and a
fresh random seed per test (printed in failure messages)."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch

if importlib.util.find_spec("sgl_kernel") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "sgl-kernel"))


@pytest.fixture
def seed() -> int:
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s
