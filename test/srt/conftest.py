"""Tiny MoE checkpoints, built once per session (a few seconds each)."""

from __future__ import annotations

from typing import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_moe_dir(arch) -> folder of a tiny random `arch` checkpoint (cached per arch)."""
    from sglang.test.moe_fixtures import build_tiny_moe

    root = tmp_path_factory.mktemp("tiny_moe")
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_moe(arch, str(root / arch))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def moe_prompts(tiny_moe_dir) -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir("mixtral"))
    texts = ["The Licensee shall not sublicense the Software without",
             "Article 5. Personal data shall be processed lawfully, fairly and in a transparent"]
    return [tok(t).input_ids for t in texts]
