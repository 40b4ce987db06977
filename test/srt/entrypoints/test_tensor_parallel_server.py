"""`--tp-size 2` serves for real: two scheduler processes (gloo on CPU, one thread each) in
lockstep behind one HTTP front give the one-rank server's greedy tokens, their pools agree
and are free after a flush; a dead rank takes the server down with a clear error; the
ranks may live in two "nodes" (--nnodes 2 --node-rank, --dist-init-addr)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from sglang.srt.utils import free_port

pytestmark = pytest.mark.slow  # server processes

PROMPTS = ["The capital of France is", "Article 5: the supplier shall", "Once upon a time"]
_PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))


def _greedy(srv, n: int = 24):
    out = []
    for p in PROMPTS:
        resp = srv.post("/generate", json={"text": p, "sampling_params": {
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        out.append(resp.json()["output_ids"])
    return out


def _ranks(srv):
    return [p for p in psutil.Process(srv.proc.pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())]


def test_tp2_server_gives_the_one_rank_tokens(server, start_server, tiny_llama_dir):
    tp2 = start_server(tiny_llama_dir, ["--context-length", "256", "--max-total-tokens", "4096",
                                        "--tp-size", "2"])
    assert _greedy(tp2) == _greedy(server)
    cached = tp2.internal_state()["tp_cache_evictable_tokens"]
    assert cached[0] > 0 and cached == [cached[0]] * 2, cached  # the same radix tree on both
    tp2.assert_all_slots_free()
    st = tp2.internal_state()
    assert st["tp_size"] == 2
    assert st["tp_available_kv_tokens"] == [st["max_total_num_tokens"]] * 2, st
    # a dead rank takes the server down, saying which
    rank0, rank1, detokenizer = sorted(_ranks(tp2), key=lambda p: p.pid)  # started in order
    rank1.send_signal(signal.SIGKILL)
    assert tp2.proc.wait(60) == 1
    assert "sglang-scheduler-tp1 process died" in tp2.log()


@pytest.mark.parametrize("spec", [
    ["--speculative-algorithm", "NGRAM", "--speculative-calibrate-seconds", "2"],
    ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3",
     "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
     "--speculative-calibrate-seconds", "0"],
], ids=["ngram", "standalone"])
def test_tp2_speculation_keeps_the_plain_tokens(spec, server, start_server, tiny_llama_dir,
                                               tiny_qwen2_dir):
    """Speculation under TP: the draft model whole on every rank, the cost model and the
    calibration fed rank 0's timings, so every rank verifies the same trees; greedy output
    is plain greedy's, and the pools (target and draft) are free on every rank after."""
    if "STANDALONE" in spec:
        spec = spec + ["--speculative-draft-model-path", tiny_qwen2_dir]
    srv = start_server(tiny_llama_dir, ["--context-length", "256", "--max-total-tokens", "4096",
                                        "--tp-size", "2", *spec])
    assert _greedy(srv) == _greedy(server)
    srv.assert_all_slots_free()
    st = srv.internal_state()
    assert st["tp_available_kv_tokens"] == [st["max_total_num_tokens"]] * 2, st
    assert st["avg_spec_accept_length"] is not None


def test_two_nodes_share_one_tp_group(server, start_server, tiny_llama_dir, tmp_path):
    port = free_port()
    common = ["--model-path", tiny_llama_dir, "--dtype", "float32", "--context-length", "256",
              "--max-total-tokens", "4096", "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{port}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *common,
                              "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        node0 = start_server(tiny_llama_dir, common[4:] + ["--node-rank", "0"])
        assert _greedy(node0) == _greedy(server)
        node0.assert_all_slots_free()
        node0.stop()
        assert node1.wait(60) == 1  # its peer rank went away: it says so and exits
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()


@pytest.mark.parametrize("store", [[], ["--moe-expert-cache-slots", "2",
                                          "--moe-prefetch-predictor", "layer_ahead"]],
                         ids=["resident", "store"])
def test_moe_server_with_expert_parallelism_gives_the_one_rank_tokens(store, start_server,
                                                                      tiny_moe_dir):
    """Mixtral with --tp-size 2 --ep-size 2 (four whole experts per rank) through the whole
    server: the tokens of the one-process model, token for token (float32); also with each
    rank's own expert store (2 slots for its 4 experts) and prefetcher."""
    import torch

    from sglang.test.harness import TinyRunner

    folder = tiny_moe_dir("mixtral")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9591, 2337, 253, 655, 28, 281]]
    torch.set_num_threads(1)
    want = TinyRunner(folder).generate_greedy(prompts, 16)
    srv = start_server(folder, ["--tp-size", "2", "--ep-size", "2", "--max-total-tokens",
                                "4096", "--skip-server-warmup", *store])
    for ids, expected in zip(prompts, want):
        resp = srv.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == expected
    if store:  # rank 0's figures: its own store and prefetcher ran
        state = srv.get("/server_info").json()["internal_states"][0]
        assert state["moe_expert_store"]["total"]["loads"] > 0
        assert state["moe_prefetch"]["total"]["uses"] > 0
    srv.assert_all_slots_free()


@pytest.mark.parametrize("algo", ["NEXTN", "EAGLE3"])
def test_tp2_draft_heads_keep_the_one_rank_tokens(algo, start_server, tiny_llama_dir,
                                                 tmp_path_factory):
    """A draft head under --tp-size 2: the head whole on every rank, reading the target's
    vocab-parallel embedding and lm_head and its (all-reduced) hidden states: NEXTN (a
    DeepSeek-V3 target's own MTP layer, MLA and experts) and an EAGLE-3 head (Llama)."""
    import torch

    from sglang.test.eagle_fixtures import build_tiny_deepseek_mtp, build_tiny_eagle3_head
    from sglang.test.harness import TinyRunner

    root = tmp_path_factory.mktemp("tp_heads")
    if algo == "NEXTN":
        folder, extra = build_tiny_deepseek_mtp(str(root / "ds")), []
    else:
        folder = tiny_llama_dir
        extra = ["--speculative-draft-model-path",
                 build_tiny_eagle3_head(folder, str(root / "head"))]
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9591, 2337, 253, 655, 28, 281]]
    torch.set_num_threads(1)
    want = TinyRunner(folder).generate_greedy(prompts, 16)
    srv = start_server(folder, ["--tp-size", "2", "--max-total-tokens", "4096",
                                "--context-length", "256", "--skip-server-warmup",
                                "--speculative-algorithm", algo, "--speculative-num-steps", "3",
                                "--speculative-eagle-topk", "2",
                                "--speculative-num-draft-tokens", "5",
                                "--speculative-calibrate-seconds", "0", *extra])
    for ids, expected in zip(prompts, want):
        resp = srv.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == expected
        assert resp.json()["meta_info"]["spec_verify_ct"] > 0
    srv.assert_all_slots_free()
