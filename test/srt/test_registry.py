"""One registry of names: the CLI's choices come from it, every entry loads, and flags this
fork keeps only for upstream's command lines say so when set."""

from __future__ import annotations

import warnings

import pytest

from sglang.srt.registry import ATTENTION_BACKENDS, EXPERT_PREDICTORS, SPECULATIVE_ALGORITHMS
from sglang.srt.server_args import IGNORED_FLAGS, ServerArgs


@pytest.mark.parametrize("registry", [SPECULATIVE_ALGORITHMS, EXPERT_PREDICTORS,
                                      ATTENTION_BACKENDS])
def test_every_registered_name_loads(registry):
    for name in registry.names:
        assert callable(registry.load(name)), name
    with pytest.raises(ValueError, match=registry.flag):
        registry.load("no-such-name")


def test_server_args_take_their_choices_from_the_registry():
    with pytest.raises(ValueError, match="layer_ahead"):  # the message lists the choices
        ServerArgs(model_path="x", moe_prefetch_predictor="oracle")
    with pytest.raises(ValueError, match="--attention-backend"):
        ServerArgs(model_path="x", attention_backend="flashinfer")  # not built here
    with pytest.raises(ValueError, match="STANDALONE, NGRAM, HYBRID"):
        ServerArgs(model_path="x", speculative_algorithm="MEDUSA")


def test_moe_runner_backends_here_and_where_they_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="use auto .* or triton"):
        ServerArgs(model_path="x", moe_runner_backend="flashinfer_cutlass")
    with pytest.raises(ValueError, match="needs --device cuda"):
        ServerArgs(model_path="x", moe_runner_backend="triton")
    assert ServerArgs(model_path="x", device="cuda", moe_runner_backend="triton")
    from sglang.srt.layers.moe.runner import resolve_moe_runner

    assert resolve_moe_runner("auto", "cpu") == "torch"
    assert resolve_moe_runner("triton", "cuda:1") == "triton"


def test_device_auto_picks_cuda_only_where_torch_sees_a_gpu():
    import torch

    want = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(model_path="x", device="auto")
    assert args.device == want
    assert args.attention_backend == ("torch_native" if want == "cpu" else "triton")


def test_an_ignored_upstream_flag_warns_only_when_set():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ServerArgs(model_path="x")  # every ignored flag at its inert value: silent
    for name, (inert, _) in IGNORED_FLAGS.items():
        value = {bool: True, int: 7, float: 2.5}.get(type(inert), "other")
        with pytest.warns(UserWarning, match=f"--{name.replace('_', '-')}"):
            ServerArgs(model_path="x", **{name: value})


def test_half_precision_on_cpu_is_an_error_that_names_the_fix():
    for dtype in ("float16", "half"):
        with pytest.raises(ValueError, match="--dtype bfloat16"):
            ServerArgs(model_path="x", dtype=dtype)
