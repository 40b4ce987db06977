"""Decode batches replay captured graphs (model_executor/cuda_graph_runner.py) and give the
eager forward's tokens: padding rows, static buffers and the metadata filled outside the
graph change nothing a request sees.

Without a GPU the graphs are `EagerGraph`s (the captured function re-run on the same static
buffers, host reads forbidden while capturing, as a CUDA capture forbids them) and the
Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1 before the first import).
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
from sglang.test.triton_env import interpret_triton_without_a_gpu  # noqa: E402

interpret_triton_without_a_gpu()

from sglang.srt.managers.scheduler_process import scheduler_info  # noqa: E402
from sglang.srt.model_executor.cuda_graph_runner import (  # noqa: E402
    EagerGraph, GraphConfig, default_batch_sizes)
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang.test.scheduler_driver import greedy, make_scheduler, run  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU, scripts/gpu_check.sh runs real graphs")

# different lengths, so the batch shrinks 3 -> 2 -> 1 (sizes 3 pad to 4; 2 and 1 exact);
# the tiny model answers the first by repeating one token: n-grams draft it
PROMPTS = [[3] * 8, [7, 8], list(range(100, 131))]
PARAMS = [greedy(9), greedy(4), greedy(6)]


def _graphs(sched, sizes=(1, 2, 4), padding=True):
    """Graphs as a CUDA server captures them: decode, and a speculative server's verifies."""
    verify = sched.spec.max_tree_nodes if sched.spec and not sched.spec.capture_layers else 0
    sched.runner.attach_graphs(GraphConfig(batch_sizes=sizes, padding=padding), EagerGraph,
                               verify_tokens=verify)
    return sched.runner.graph_runner


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return run(make_scheduler(tiny_llama_dir), PROMPTS, PARAMS)


def test_flags_parse_as_upstream_and_pick_the_batch_sizes():
    args = prepare_server_args(["--cuda-graph-max-bs", "8", "--disable-cuda-graph-padding"])
    assert args.cuda_graph_max_bs == 8 and args.disable_cuda_graph_padding
    cfg = GraphConfig.from_server_args(args, "cuda", max_running_requests=48)
    assert cfg.batch_sizes == (1, 2, 4, 8) and not cfg.padding
    args = prepare_server_args(["--cuda-graph-bs", "1", "3", "64"])
    assert args.cuda_graph_bs == [1, 3, 64]
    # sizes beyond --max-running-requests never run: not captured
    assert GraphConfig.from_server_args(args, "cuda:1", 48).batch_sizes == (1, 3)
    assert default_batch_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert default_batch_sizes(20)[-1] == 20
    off = GraphConfig.from_server_args(prepare_server_args(["--disable-cuda-graph"]), "cuda", 8)
    assert not off.enabled and "--disable-cuda-graph" in off.why_off
    assert "cpu" in GraphConfig.from_server_args(ServerArgs(), "cpu", 8).why_off
    with pytest.raises(ValueError, match="--cuda-graph-bs"):
        ServerArgs(cuda_graph_bs=[0, 2])
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0)


@pytest.mark.parametrize("spec", [
    {}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 2,
     "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4},
    {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
     "speculative_eagle_topk": 1},
], ids=["plain", "ngram", "standalone-tree", "standalone-chain"])
def test_decode_and_verify_graphs_give_the_eager_tokens(tiny_llama_dir, reference, spec):
    if spec.get("speculative_algorithm") == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": tiny_llama_dir}
    sched = make_scheduler(tiny_llama_dir, attention_backend="triton", **spec)
    graphs = _graphs(sched)
    got = run(sched, PROMPTS, PARAMS)
    for rid, (ids, _) in reference.items():
        assert got[rid][0] == ids, f"request {rid}"
    stats = graphs.stats
    assert stats.padded_rows > 0  # 3 requests padded to 4 (and trees to the node budget)
    info = scheduler_info(sched)["cuda_graph"]
    assert info["enabled"] and info["batch_sizes"] == [1, 2, 4]
    if spec:  # every step verifies a tree (speculation forced on), through a graph
        assert info["verify_tokens"] == sched.spec.max_tree_nodes
        assert stats.verify_replays > 0 and stats.eager == 0
    else:
        assert stats.replays > 0 and info["verify_tokens"] == 0
    sched.check_all_free()


def test_without_padding_other_sizes_run_eagerly(tiny_llama_dir, reference):
    sched = make_scheduler(tiny_llama_dir, attention_backend="triton")
    graphs = _graphs(sched, sizes=(1, 2), padding=False)
    got = run(sched, PROMPTS, PARAMS)
    assert {rid: ids for rid, (ids, _) in got.items()} == {
        rid: ids for rid, (ids, _) in reference.items()}
    assert graphs.stats.eager > 0 and graphs.stats.replays > 0
    assert graphs.stats.padded_rows == 0
    sched.check_all_free()


def test_a_host_read_inside_a_capture_is_refused():
    x = torch.arange(4)
    with pytest.raises(RuntimeError, match="reads a device value"):
        EagerGraph().capture(lambda: x * int(x.sum()), None)
    with pytest.raises(RuntimeError, match="reads a device value"):
        EagerGraph().capture(lambda: x[x > 1], None)
    g = EagerGraph()
    out = g.capture(lambda: x * 2, None)
    x.add_(1)
    g.replay()
    assert out.tolist() == [2, 4, 6, 8]  # replay writes the captured output in place


def test_what_cannot_be_captured_runs_eagerly_and_says_why(tiny_llama_dir, tiny_moe_dir):
    sched = make_scheduler(tiny_llama_dir)  # torch_native: loops over requests on the host
    _graphs(sched)
    info = sched.runner.graph_info()
    assert not info["enabled"] and "torch_native" in info["why_off"]
    moe = make_scheduler(tiny_moe_dir("mixtral"), attention_backend="triton",
                         moe_expert_cache_slots=2)
    _graphs(moe)
    assert "--moe-expert-cache-slots" in moe.runner.graph_info()["why_off"]
    moe = make_scheduler(tiny_moe_dir("mixtral"), attention_backend="triton")  # torch runner
    _graphs(moe)
    assert "--moe-runner-backend" in moe.runner.graph_info()["why_off"]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_moe_and_mla_decode_graphs_give_the_eager_tokens(tiny_moe_dir, moe_prompts, arch):
    folder = tiny_moe_dir(arch)
    params = [greedy(5), greedy(3)]
    want = run(make_scheduler(folder, attention_backend="triton", moe_runner_backend="triton"),
               moe_prompts, params)
    sched = make_scheduler(folder, attention_backend="triton", moe_runner_backend="triton")
    graphs = _graphs(sched, sizes=(1, 2))
    got = run(sched, moe_prompts, params)
    assert {r: ids for r, (ids, _) in got.items()} == {r: ids for r, (ids, _) in want.items()}
    assert graphs.stats.replays > 0
    sched.check_all_free()
