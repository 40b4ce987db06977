from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> str:
    """A draft unrelated to the target: other seed, one layer (accepts little)."""
    from sglang.test.fixtures import build_tiny_model

    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny") / "draft"), seed=1,
                            num_hidden_layers=1)
