"""Parallelism flags as upstream names them, each refusal saying what to change; the
sglang-router's launch_server finds what it imports from us."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.srt.server_args import ServerArgs, prepare_server_args


@pytest.mark.parametrize("flags, message", [
    (dict(tp_size=2, ep_size=3), "--ep-size 3 must be 1"),
    (dict(tp_size=2, nnodes=2), "--dist-init-addr HOST:PORT"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "must be a multiple of --nnodes"),
    (dict(nnodes=2, node_rank=2, tp_size=2, dist_init_addr="h:1"), "--node-rank must be in"),
    (dict(dist_init_addr="no-port"), "HOST:PORT"),
    (dict(grpc_mode=True), "--grpc-mode is not supported"),
    (dict(max_request_body_bytes=10), "at least 1024"),
    (dict(tp_size=2, moe_expert_cache_slots=2), "needs --ep-size 2"),
    (dict(tp_size=2, ep_size=2, moe_expert_cache_slots=2, moe_prefetch_prune_tree=True),
     "leave it off"),
])
def test_bad_parallel_flags_are_refused_with_what_to_change(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="m", **flags)


def test_upstream_spellings_parse():
    args = prepare_server_args(["--model-path", "m", "--tensor-parallel-size", "2",
                                "--expert-parallel-size", "2", "--dp-size", "3",
                                "--base-gpu-id", "1", "--max-request-body-bytes", "2M"])
    assert (args.tp_size, args.ep_size, args.dp_size, args.base_gpu_id) == (2, 2, 3, 1)
    assert args.max_request_body_bytes == 2 * 1024 * 1024
    # the router's launcher gives each replica base_gpu_id = rank * tp_size
    assert ServerArgs(model_path="m", device="cuda", base_gpu_id=2, tp_size=2,
                      attention_backend="torch_native").torch_device(1) == "cuda:3"


def test_dp_size_on_our_own_server_points_to_the_router():
    """ServerArgs takes --dp-size (the router's launch_server builds it with N, then starts
    N replicas with 1); our launch_server refuses N > 1 at once, exit 2, naming both ways."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "m",
                          "--dp-size", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "sglang_router.launch_server --dp-size N" in out.stderr
    assert "sglang_router.launch_router" in out.stderr


def test_port_helper_at_upstreams_path():
    import socket

    from sglang.srt.utils import free_port, is_port_available

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not is_port_available(s.getsockname()[1])
    assert is_port_available(free_port())
