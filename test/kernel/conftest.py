"""Shared setup of the CPU kernel tests: a fresh random seed per test (printed in failure
messages). `sgl_kernel` is importable from the checkout through test/conftest.py."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    return s
