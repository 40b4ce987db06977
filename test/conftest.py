"""Shared pytest setup: make `sglang` importable from the checkout; tiny model fixtures."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
if importlib.util.find_spec("sglang") is None:
    sys.path.insert(0, _PYTHON_DIR)


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
